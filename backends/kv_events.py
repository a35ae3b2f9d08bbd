"""Engine KV-cache events: the vLLM / SGLang ZMQ wire format, and the engines' block hashes.

Pure (no sockets, no clock): bytes in, typed events out, and back.

Wire format (vLLM ``ZmqEventPublisher``; SGLang uses the same framing):

* one ZMQ message = three frames ``[topic, seq, payload]``; ``seq`` is an 8-byte
  big-endian unsigned counter per publisher (``0xff`` × 8, i.e. -1 signed, marks the end
  of a replay);
* ``payload`` is msgpack ``[ts, events, data_parallel_rank]``;
* each event is either a map with a ``"type"`` key (newer vLLM; defaulted fields omitted)
  or a positional array whose first item is the type name (older vLLM, SGLang), fields in
  the order of :data:`_FIELDS`. Unknown fields and trailing extra items are ignored;
  unknown event types decode to :class:`UnknownEvent`.

A payload that cannot be read raises :class:`KVEventDecodeError` (the subscriber logs and
counts it, never dies of it).

Block hashes arrive as ints (vLLM: the last 8 bytes of the sha256 digest, big-endian
unsigned; SGLang: a signed int64) or, when an engine publishes raw digests, as bytes —
normalised here to the int vLLM would publish (last 8 bytes, big-endian).

Hash functions: :func:`vllm_block_digests` reproduces vLLM's default ``sha256`` prefix-cache
hash (``NONE_HASH`` root, pickled ``(parent, tokens, extra_keys)``), :func:`sglang_block_hashes`
SGLang's chained sha256 over 4-byte little-endian tokens.
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

END_SEQ = -1
_U64 = (1 << 64) - 1


class KVEventDecodeError(ValueError):
    """A frame or payload that is not a KV-event message."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks the engine just cached: ``len(block_hashes)`` full blocks whose tokens are
    ``token_ids`` (``block_size`` each), chained after ``parent_block_hash``."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None  # per block (vLLM >= 0.11), else None
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine evicted."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (``/reset_prefix_cache``, restart...)."""

    medium: str | None = None


@dataclass(frozen=True, slots=True)
class UnknownEvent:
    """An event type this decoder does not know (kept so it can be counted)."""

    type: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One payload: engine wall time ``ts`` (seconds), its events, the DP rank."""

    ts: float
    events: tuple[KVEvent, ...] = ()
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class EventMessage:
    """One ZMQ message: ``topic``, ``seq`` and the decoded batch."""

    topic: str
    seq: int
    batch: EventBatch = field(default_factory=lambda: EventBatch(0.0))


# Positional field order of the array encoding (after the type tag), as in vLLM's
# msgspec structs (array_like=True, tag=True); newer fields are appended by vLLM.
_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": ("medium",),
}
_REQUIRED: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}


# ---------------------------------------------------------------- decoding

def decode_seq(raw: bytes) -> int:
    """The 8-byte big-endian sequence number; the all-ones end marker is -1."""
    if len(raw) != 8:
        raise KVEventDecodeError(f"seq frame has {len(raw)} bytes, expected 8")
    if raw == b"\xff" * 8:
        return END_SEQ
    return int.from_bytes(raw, "big")


def encode_seq(seq: int) -> bytes:
    return b"\xff" * 8 if seq == END_SEQ else int(seq).to_bytes(8, "big")


def normalize_hash(value: Any) -> int:
    """An engine block hash as an int (bytes digests → last 8 bytes big-endian)."""
    if isinstance(value, bool):
        raise KVEventDecodeError("block hash is a bool")
    if isinstance(value, int):
        return value
    if isinstance(value, bytes | bytearray):
        if not value:
            raise KVEventDecodeError("empty block hash")
        return int.from_bytes(bytes(value[-8:]), "big")
    raise KVEventDecodeError(f"block hash of type {type(value).__name__}")


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVEventDecodeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def _opt_str(value: Any, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise KVEventDecodeError(f"{name} must be a string")


def _hash_list(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise KVEventDecodeError(f"{name} must be a list")
    return tuple(normalize_hash(v) for v in value)


def _event_from_fields(kind: str, f: dict[str, Any]) -> KVEvent:
    missing = [k for k in _REQUIRED[kind] if k not in f]
    if missing:
        raise KVEventDecodeError(f"{kind} without {', '.join(missing)}")
    if kind == "BlockStored":
        toks = f["token_ids"]
        if not isinstance(toks, list | tuple):
            raise KVEventDecodeError("token_ids must be a list")
        parent = f.get("parent_block_hash")
        extra = f.get("extra_keys")
        return BlockStored(
            block_hashes=_hash_list(f["block_hashes"], "block_hashes"),
            parent_block_hash=None if parent is None else normalize_hash(parent),
            token_ids=_token_tuple(toks),
            block_size=_int(f["block_size"], "block_size"),
            lora_id=None if f.get("lora_id") is None else _int(f["lora_id"], "lora_id"),
            medium=_opt_str(f.get("medium"), "medium"),
            lora_name=_opt_str(f.get("lora_name"), "lora_name"),
            extra_keys=None if extra is None else tuple(_freeze(x) for x in extra)
            if isinstance(extra, list | tuple) else None,
            group_idx=_int(f.get("group_idx") or 0, "group_idx"),
            kv_cache_spec_kind=_opt_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hash_list(f["block_hashes"], "block_hashes"),
            medium=_opt_str(f.get("medium"), "medium"),
            group_idx=_int(f.get("group_idx") or 0, "group_idx"),
        )
    return AllBlocksCleared(medium=_opt_str(f.get("medium"), "medium"))


def _token_tuple(toks: list[Any] | tuple[Any, ...]) -> tuple[int, ...]:
    """Token ids as a tuple, checked to be integers at C speed (the hot part of decoding)."""
    try:
        array("q", toks)
    except (TypeError, OverflowError) as exc:
        raise KVEventDecodeError(f"token_ids must be 64-bit integers: {exc}") from exc
    return tuple(toks)


def _freeze(x: Any) -> Any:
    if isinstance(x, list | tuple):
        return tuple(_freeze(i) for i in x)
    return x


def decode_event(obj: Any) -> KVEvent:
    """One event from its map or array form."""
    if isinstance(obj, dict):
        kind = obj.get("type")
        if not isinstance(kind, str):
            raise KVEventDecodeError("event map without a string 'type'")
        if kind not in _FIELDS:
            return UnknownEvent(kind)
        return _event_from_fields(kind, {k: v for k, v in obj.items() if k != "type"})
    if isinstance(obj, list | tuple):
        if not obj or not isinstance(obj[0], str):
            raise KVEventDecodeError("event array without a type name first")
        kind = obj[0]
        if kind not in _FIELDS:
            return UnknownEvent(kind)
        names = _FIELDS[kind]
        return _event_from_fields(kind, dict(zip(names, obj[1:], strict=False)))
    raise KVEventDecodeError(f"event of type {type(obj).__name__}")


def decode_payload(payload: bytes) -> EventBatch:
    """A msgpack ``[ts, events, data_parallel_rank]`` payload (a map form is accepted too)."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise KVEventDecodeError(f"not msgpack: {exc}") from exc
    if isinstance(obj, dict):
        obj = [obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")]
    if not isinstance(obj, list | tuple) or len(obj) < 2:
        raise KVEventDecodeError("payload is not [ts, events, dp_rank]")
    ts, events = obj[0], obj[1]
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KVEventDecodeError("batch ts is not a number")
    if not isinstance(events, list | tuple):
        raise KVEventDecodeError("batch events is not a list")
    rank = obj[2] if len(obj) > 2 else None
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        rank = None
    return EventBatch(float(ts), tuple(decode_event(e) for e in events), rank)


def decode_message(frames: Sequence[bytes]) -> EventMessage:
    """A three-frame ``[topic, seq, payload]`` message."""
    if len(frames) != 3:
        raise KVEventDecodeError(f"message has {len(frames)} frames, expected 3")
    topic = bytes(frames[0]).decode("utf-8", "replace")
    return EventMessage(topic, decode_seq(bytes(frames[1])), decode_payload(bytes(frames[2])))


# ---------------------------------------------------------------- encoding

def _event_map(ev: KVEvent) -> dict[str, Any]:
    if isinstance(ev, BlockStored):
        d: dict[str, Any] = {
            "type": "BlockStored", "block_hashes": list(ev.block_hashes),
            "parent_block_hash": ev.parent_block_hash, "token_ids": list(ev.token_ids),
            "block_size": ev.block_size, "lora_id": ev.lora_id, "medium": ev.medium,
            "lora_name": ev.lora_name,
        }
        if ev.extra_keys is not None:
            d["extra_keys"] = [list(x) if isinstance(x, tuple) else x for x in ev.extra_keys]
        d["group_idx"] = ev.group_idx
        if ev.kv_cache_spec_kind is not None:
            d["kv_cache_spec_kind"] = ev.kv_cache_spec_kind
        return d
    if isinstance(ev, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(ev.block_hashes), "medium": ev.medium,
                "group_idx": ev.group_idx}
    if isinstance(ev, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"cannot encode {ev!r}")


def _event_array(ev: KVEvent) -> list[Any]:
    # The older vLLM / SGLang positional layout (no newer fields).
    if isinstance(ev, BlockStored):
        return ["BlockStored", list(ev.block_hashes), ev.parent_block_hash, list(ev.token_ids),
                ev.block_size, ev.lora_id, ev.medium, ev.lora_name]
    if isinstance(ev, BlockRemoved):
        return ["BlockRemoved", list(ev.block_hashes), ev.medium]
    if isinstance(ev, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"cannot encode {ev!r}")


ENCODINGS = ("map", "array")


def encode_payload(batch: EventBatch, encoding: str = "map") -> bytes:
    """msgpack ``[ts, events, dp_rank]`` with events as maps (newer vLLM) or arrays."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}")
    conv = _event_map if encoding == "map" else _event_array
    return msgpack.packb([batch.ts, [conv(e) for e in batch.events], batch.data_parallel_rank],
                         use_bin_type=True)


def encode_message(topic: str, seq: int, batch: EventBatch, encoding: str = "map") -> list[bytes]:
    return [topic.encode(), encode_seq(seq), encode_payload(batch, encoding)]


# ---------------------------------------------------------------- engine hashes

NONE_HASH: bytes = hashlib.sha256(pickle.dumps("vllm-none-hash", pickle.HIGHEST_PROTOCOL)).digest()


def vllm_extra_keys(block_index: int, lora_name: str | None = None,
                    cache_salt: str | None = None) -> tuple[Any, ...] | None:
    """vLLM's per-block extra keys (text-only prompts): the LoRA name on every block, then
    ``cache_salt`` on the first block only; ``None`` when there are none."""
    keys: list[Any] = []
    if lora_name:
        keys.append(lora_name)
    if cache_salt and block_index == 0:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def vllm_block_digests(tokens: Sequence[int], block_size: int, *, lora_name: str | None = None,
                       cache_salt: str | None = None, parent: bytes | None = None,
                       start_block: int = 0) -> list[bytes]:
    """vLLM's ``sha256`` block hashes (32-byte digests) of every full block of ``tokens``:
    ``h_i = sha256(pickle.dumps((h_{i-1}, tuple(block_tokens), extra_keys), HIGHEST_PROTOCOL))``
    with ``h_{-1} = NONE_HASH``. ``parent``/``start_block`` resume a chain."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    h = NONE_HASH if parent is None else parent
    out: list[bytes] = []
    for b in range(start_block, len(tokens) // block_size):
        blk = tuple(int(t) for t in tokens[b * block_size:(b + 1) * block_size])
        key = (h, blk, vllm_extra_keys(b, lora_name, cache_salt))
        h = hashlib.sha256(pickle.dumps(key, pickle.HIGHEST_PROTOCOL)).digest()
        out.append(h)
    return out


def vllm_event_hash(digest: bytes) -> int:
    """The int vLLM publishes for a block digest: its last 8 bytes, big-endian unsigned."""
    return int.from_bytes(digest[-8:], "big")


def vllm_block_hashes(tokens: Sequence[int], block_size: int, **kw: Any) -> list[int]:
    """The published (event) values of :func:`vllm_block_digests`."""
    return [vllm_event_hash(d) for d in vllm_block_digests(tokens, block_size, **kw)]


def sglang_hash_str(tokens: Iterable[int], prior_hash: str | None = None) -> str:
    """SGLang's page hash: sha256 over the parent's digest then 4-byte little-endian tokens."""
    h = hashlib.sha256()
    if prior_hash:
        h.update(bytes.fromhex(prior_hash))
    for t in tokens:
        h.update((int(t) & 0xFFFFFFFF).to_bytes(4, "little"))
    return h.hexdigest()


def sglang_event_hash(hex_digest: str) -> int:
    """SGLang's published value: the first 16 hex digits as a signed int64."""
    v = int(hex_digest[:16], 16)
    return v - (1 << 64) if v >= (1 << 63) else v


def sglang_block_hashes(tokens: Sequence[int], page_size: int) -> list[int]:
    """SGLang's event values for every full page of ``tokens``."""
    out: list[int] = []
    prior: str | None = None
    for b in range(len(tokens) // page_size):
        prior = sglang_hash_str(tokens[b * page_size:(b + 1) * page_size], prior)
        out.append(sglang_event_hash(prior))
    return out


class VllmBlockHasher:
    """vLLM's sha256 chain as a simulator block hasher:
    ``hasher(tokens, block_size, *, parent, model, lora, cache_salt) -> event hashes``.

    Chains continue from a 64-bit ``parent`` (what engines publish), so the full digests of
    recent blocks are kept in a bounded map (oldest dropped first). The model name does not
    enter vLLM's hash (one engine serves one model)."""

    def __init__(self, max_entries: int = 1_000_000) -> None:
        self.max_entries = max_entries
        self._digests: dict[int, bytes] = {}

    def __call__(self, tokens: Sequence[int], block_size: int, *, parent: int | None = None,
                 model: str = "", lora: str | None = None, cache_salt: str | None = None) -> list[int]:
        if parent is None:
            digests = vllm_block_digests(tokens, block_size, lora_name=lora, cache_salt=cache_salt)
        else:
            pd = self._digests.get(parent)
            if pd is None:  # parent fell out of the map: fall back to a deterministic stand-in
                pd = hashlib.sha256(parent.to_bytes(8, "big")).digest()
            digests = _continue(tokens, block_size, pd, lora)  # salt is a first-block key only
        out = []
        d = self._digests
        for dg in digests:
            h = vllm_event_hash(dg)
            d.pop(h, None)
            d[h] = dg
            out.append(h)
        over = len(d) - self.max_entries
        if over > 0:
            for k in list(d)[:over]:
                del d[k]
        return out


def _continue(tokens: Sequence[int], block_size: int, parent: bytes, lora: str | None) -> list[bytes]:
    """Digests of blocks that are not a prompt's first (no cache_salt in their extra keys)."""
    h = parent
    out: list[bytes] = []
    extra = (lora,) if lora else None
    for b in range(len(tokens) // block_size):
        blk = tuple(int(t) for t in tokens[b * block_size:(b + 1) * block_size])
        h = hashlib.sha256(pickle.dumps((h, blk, extra), pickle.HIGHEST_PROTOCOL)).digest()
        out.append(h)
    return out
