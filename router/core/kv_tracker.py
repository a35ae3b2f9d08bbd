"""Exact cache tracking, the pure part: engine KV events → prefix-index operations.

One :class:`ReplicaTracker` per engine. Engines name blocks with their own hashes (vLLM's
sha256, SGLang's, or anything else); the router's index uses its own chain
(:mod:`router.core.hashing`). So on ``BlockStored`` the tracker re-hashes ``token_ids``
with the router's chain, starting from the router hash of ``parent_block_hash`` (found in a
per-replica engine-hash → router-hash map) or, for a first block, from the seed the router
gives a request (``seed_hash(model, None, cache_salt)``, where a LoRA adapter's name is the
model name requests use), records those router hashes, and remembers the mapping so a later
``BlockRemoved`` finds what to remove. ``AllBlocksCleared`` (or :meth:`reset`) clears the
replica and the map.

Engine and router block sizes may differ when the engine's is a multiple of the router's:
an engine block then maps to ``engine // router`` router blocks. A stored block whose
parent is unknown (its prefix was stored before the tracker started, or was lost) cannot
be re-hashed and is skipped (counted as ``unknown_parent``): the index under-reports,
never invents.

:class:`SeqTracker` classifies each message's sequence number (next / gap / reset).
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from backends.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, UnknownEvent
from router.core.hashing import block_hashes, seed_hash

OpKind = Literal["record", "remove", "clear"]
SeqVerdict = Literal["first", "next", "gap", "old"]


@dataclass(slots=True)
class IndexOp:
    """One write for the prefix index: record/remove router ``hashes``, or clear the replica."""

    kind: OpKind
    hashes: list[int] = field(default_factory=list)
    model: str | None = None  # for records: the model name the blocks are indexed under


@dataclass(slots=True)
class TrackerStats:
    stored_blocks: int = 0
    removed_blocks: int = 0
    clears: int = 0
    unknown_parent: int = 0      # BlockStored skipped: parent not in the map
    unknown_removed: int = 0     # BlockRemoved for a hash not in the map
    skipped: int = 0             # other medium / group, unsupported block size, bad lengths
    unknown_events: int = 0
    map_evictions: int = 0       # map entries dropped at the size bound


class SeqTracker:
    """Per-publisher sequence numbers: the next one expected, gaps, resets."""

    def __init__(self) -> None:
        self.last: int | None = None

    def check(self, seq: int) -> SeqVerdict:
        """Classify ``seq`` against the last accepted one (does not accept it)."""
        if self.last is None:
            return "first"
        if seq == self.last + 1:
            return "next"
        if seq > self.last + 1:
            return "gap"
        return "old"

    def accept(self, seq: int) -> None:
        self.last = seq


def _salt_from_extra(extra: object, lora_name: str | None) -> str | None:
    """``cache_salt`` from a first block's vLLM extra keys (LoRA name first, then salt)."""
    if not isinstance(extra, tuple):
        return None
    for k in extra:
        if isinstance(k, str) and k != lora_name:
            return k
    return None


class ReplicaTracker:
    """Engine events of one replica → router-hash index operations."""

    def __init__(self, replica: str, model: str, block_size: int, *,
                 mediums: Collection[str] = ("GPU", "gpu"), group_idx: int = 0,
                 max_map: int = 2_000_000) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.replica = replica
        self.model = model
        self.block_size = block_size
        self.mediums = frozenset(mediums)
        self.group_idx = group_idx
        self.max_map = max_map
        self.stats = TrackerStats()
        self._map: dict[int, tuple[int, ...]] = {}
        self._held: dict[int, int] = {}  # router hash -> number of engine blocks mapping to it

    def __len__(self) -> int:
        return len(self._map)

    def router_hashes(self, engine_hash: int) -> tuple[int, ...] | None:
        return self._map.get(engine_hash)

    def holds(self, router_hash: int) -> bool:
        """True when an engine event says the replica holds this router block."""
        return router_hash in self._held

    def reset(self) -> None:
        """Forget every mapping (the caller clears the replica in the index)."""
        self._map = {}
        self._held = {}

    def _put(self, eh: int, rh: tuple[int, ...]) -> None:
        self._drop(eh)
        self._map[eh] = rh
        held = self._held
        for h in rh:
            held[h] = held.get(h, 0) + 1

    def _drop(self, eh: int) -> tuple[int, ...] | None:
        rh = self._map.pop(eh, None)
        if rh is not None:
            held = self._held
            for h in rh:
                n = held.get(h, 0) - 1
                if n > 0:
                    held[h] = n
                else:
                    held.pop(h, None)
        return rh

    def _accepts(self, medium: str | None, group_idx: int) -> bool:
        return (medium is None or medium in self.mediums) and group_idx == self.group_idx

    def apply(self, batch: EventBatch) -> list[IndexOp]:
        """The index writes for one batch, in order (consecutive writes of a kind merged)."""
        ops: list[IndexOp] = []

        def emit(kind: OpKind, hashes: list[int], model: str | None = None) -> None:
            if kind == "clear":
                ops.clear()  # nothing before a clear matters
                ops.append(IndexOp("clear"))
            elif hashes:
                if ops and ops[-1].kind == kind and ops[-1].model == model:
                    ops[-1].hashes.extend(hashes)
                else:
                    ops.append(IndexOp(kind, list(hashes), model))

        for ev in batch.events:
            if isinstance(ev, BlockStored):
                emit("record", self._stored(ev), ev.lora_name or self.model)
            elif isinstance(ev, BlockRemoved):
                emit("remove", self._removed(ev))
            elif isinstance(ev, AllBlocksCleared):
                if ev.medium is None or ev.medium in self.mediums:
                    self.reset()
                    self.stats.clears += 1
                    emit("clear", [])
            elif isinstance(ev, UnknownEvent):
                self.stats.unknown_events += 1
        return ops

    def _stored(self, ev: BlockStored) -> list[int]:
        if not self._accepts(ev.medium, ev.group_idx):
            self.stats.skipped += 1
            return []
        n = len(ev.block_hashes)
        be, br = ev.block_size, self.block_size
        if n == 0 or be <= 0 or be % br or len(ev.token_ids) < n * be:
            self.stats.skipped += 1
            return []
        if ev.parent_block_hash is None:
            first_extra = ev.extra_keys[0] if ev.extra_keys else None
            parent = None
            # as the router seeds a request: its model name (a LoRA adapter is requested by
            # its own name) and cache_salt
            seed = seed_hash(ev.lora_name or self.model, None, _salt_from_extra(first_extra, ev.lora_name))
        else:
            chain = self._map.get(ev.parent_block_hash)
            if chain is None:
                self.stats.unknown_parent += 1
                return []
            parent, seed = chain[-1], 0
        hashes = block_hashes(ev.token_ids[: n * be], br, seed, parent=parent)
        k = be // br
        for i, eh in enumerate(ev.block_hashes):  # (re-)inserted last: recency order for the bound
            self._put(eh, tuple(hashes[i * k:(i + 1) * k]))
        self._bound()
        self.stats.stored_blocks += n
        return hashes

    def _removed(self, ev: BlockRemoved) -> list[int]:
        if not self._accepts(ev.medium, ev.group_idx):
            self.stats.skipped += 1
            return []
        out: list[int] = []
        for eh in ev.block_hashes:
            rh = self._drop(eh)
            if rh is None:
                self.stats.unknown_removed += 1
            else:
                out.extend(rh)
                self.stats.removed_blocks += 1
        return out

    def _bound(self) -> None:
        over = len(self._map) - self.max_map
        if over > 0:
            for eh in list(self._map)[:over]:  # oldest first
                self._drop(eh)
            self.stats.map_evictions += over


def apply_engine_events(index: Any, replica: str, events: Iterable[Any], now: float) -> int:
    """Apply a simulated engine's own KV events straight to a pure :class:`PrefixIndex`
    (offline replay in exact mode, where engine and router hashes are the same values):
    ``BlockStored`` → record, ``BlockRemoved`` → remove, ``AllBlocksCleared`` → clear.
    Events are matched by type name. Returns the number of events applied."""
    n = 0
    for ev in events:
        kind = type(ev).__name__
        if kind == "BlockStored":
            index.record(ev.block_hashes, replica, now)
        elif kind == "BlockRemoved":
            index.remove(replica, ev.block_hashes)
        elif kind == "AllBlocksCleared":
            index.clear(replica)
        else:
            continue
        n += 1
    return n
