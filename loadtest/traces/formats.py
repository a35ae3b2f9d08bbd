"""Readers and writers for trace files: Mooncake JSONL, Bailian-style JSONL and JSONL of
OpenAI request bodies with timestamps. Each reader returns ``list[TraceRequest]`` in the
file's order; :func:`load_trace` sniffs the format from the first record.

- **Mooncake** (kvcache-ai/Mooncake ``FAST25-release/traces``; read by aiperf, guidellm,
  vLLM's and SGLang's benchmarks): ``timestamp`` in ms, ``input_length``,
  ``output_length``, ``hash_ids`` (one per ``block_size`` tokens, 512 by default). An extra
  ``block_size`` field (written by ``kvrouter trace generate``, ignored by other tools) gives
  the file's block size; an explicit ``block_size`` argument overrides it.
- **Bailian-style** (Alibaba Bailian / Qwen usage traces): ``chat_id``,
  ``parent_chat_id`` (-1 for a first turn), ``timestamp`` in seconds, ``input_length``,
  ``output_length``, ``hash_ids`` at 16 tokens a block; a conversation is the chain of
  ``parent_chat_id`` links (its root ``chat_id`` becomes ``session_id``).
- **OpenAI bodies**: ``{"timestamp": s, "endpoint"?: "chat"|"completions", "body": {...}}``
  (or the body's fields at the top level). The prompt is rendered with the built-in byte
  tokenizer (chat template for ``messages``) to get its length and hash ids.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from loadtest.traces.types import TraceFormatError, TraceRequest
from router.core import bytetok
from router.core.hashing import block_hashes, seed_hash

FORMATS = ("mooncake", "bailian", "openai")
LENGTH_SLACK_HIGH = 1.5  # warn when input_length > this × len(hash_ids) × block_size ...
LENGTH_SLACK_LOW = 0.5  # ... or < this × (len(hash_ids) - 1) × block_size (exact: in between)


def length_mismatch(input_length: int, n_ids: int, block_size: int) -> bool:
    """Whether ``n_ids`` hash ids of ``block_size`` tokens are far from ``input_length`` (a
    trace read with the wrong block size). Exact traces have (n-1)·bs < input ≤ n·bs."""
    return (input_length > LENGTH_SLACK_HIGH * n_ids * block_size
            or input_length < LENGTH_SLACK_LOW * (n_ids - 1) * block_size)


def check_lengths(requests: list[TraceRequest], source: str) -> str | None:
    """One warning line when records' hash ids do not match their input lengths, else None."""
    bad = [i for i, r in enumerate(requests) if length_mismatch(r.input_length, len(r.hash_ids), r.block_size)]
    if not bad:
        return None
    r = requests[bad[0]]
    return (f"warning: {len(bad)} of {len(requests)} requests of {source} have len(hash_ids) × block_size "
            f"far from input_length (request {bad[0]}: {len(r.hash_ids)} ids × {r.block_size} tokens for "
            f"{r.input_length} input tokens); is the block size right? (--block-size)")


def _records(lines: Iterable[str], source: str) -> Iterator[tuple[int, dict[str, Any]]]:
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{source}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{source}:{n}: expected a JSON object")
        yield n, obj


def _int(obj: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    v = obj.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
        raise TraceFormatError(f"{where}: {key!r} must be a non-negative number, got {v!r}")
    return int(v)


def _num(obj: dict[str, Any], key: str, where: str) -> float:
    v = obj.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
        raise TraceFormatError(f"{where}: {key!r} must be a non-negative number, got {v!r}")
    return float(v)


def _ids(obj: dict[str, Any], where: str) -> list[int]:
    v = obj.get("hash_ids", [])
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list of integers")
    return v


def parse_mooncake(lines: Iterable[str], block_size: int | None = None,
                   source: str = "trace") -> list[TraceRequest]:
    """Mooncake JSONL (``timestamp`` in ms). Block size: ``block_size`` if given, else the
    record's own ``block_size`` field, else 512."""
    out = []
    for n, obj in _records(lines, source):
        where = f"{source}:{n}"
        bs = block_size
        if bs is None:
            bs = _int(obj, "block_size", where, 512) if "block_size" in obj else 512
            if bs < 1:
                raise TraceFormatError(f"{where}: 'block_size' must be >= 1")
        out.append(TraceRequest(
            timestamp_s=_num(obj, "timestamp", where) / 1000.0,
            input_length=_int(obj, "input_length", where),
            output_length=_int(obj, "output_length", where, 0),
            hash_ids=_ids(obj, where),
            block_size=bs,
            session_id=str(obj["session_id"]) if "session_id" in obj else None,
        ))
    return out


def parse_bailian(lines: Iterable[str], block_size: int = 16, source: str = "trace") -> list[TraceRequest]:
    """Bailian-style JSONL (``timestamp`` in seconds, sessions from ``parent_chat_id``)."""
    out = []
    root: dict[int, int] = {}
    for n, obj in _records(lines, source):
        where = f"{source}:{n}"
        chat = _int(obj, "chat_id", where)
        parent = obj.get("parent_chat_id", -1)
        if not isinstance(parent, int) or isinstance(parent, bool):
            raise TraceFormatError(f"{where}: 'parent_chat_id' must be an integer")
        root[chat] = root.get(parent, parent) if parent >= 0 else chat
        out.append(TraceRequest(
            timestamp_s=_num(obj, "timestamp", where),
            input_length=_int(obj, "input_length", where),
            output_length=_int(obj, "output_length", where, 0),
            hash_ids=_ids(obj, where),
            block_size=block_size,
            session_id=str(root[chat]),
        ))
    return out


def prompt_tokens_of(body: dict[str, Any], endpoint: str) -> list[int]:
    """The prompt of an OpenAI body as byte-tokenizer ids (chat template for messages)."""
    if endpoint == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
            raise ValueError("'messages' must be a list of objects")
        return bytetok.encode(bytetok.render_chat(msgs))
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return bytetok.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return bytetok.encode(prompt[0])
    raise ValueError("'prompt' must be a string or a list of token ids")


def parse_openai(lines: Iterable[str], block_size: int = 16, source: str = "trace") -> list[TraceRequest]:
    """JSONL of OpenAI request bodies with ``timestamp`` in seconds."""
    out = []
    for n, obj in _records(lines, source):
        where = f"{source}:{n}"
        body = obj.get("body", None)
        if body is None:
            body = {k: v for k, v in obj.items() if k not in ("timestamp", "endpoint", "session_id")}
        if not isinstance(body, dict):
            raise TraceFormatError(f"{where}: 'body' must be an object")
        endpoint = obj.get("endpoint") or ("chat" if "messages" in body else "completions")
        endpoint = "chat" if "chat" in str(endpoint) else "completions"
        ts = _num(obj, "timestamp", where)
        try:
            toks = prompt_tokens_of(body, endpoint)
        except ValueError as exc:
            raise TraceFormatError(f"{where}: {exc}") from None
        model = str(body.get("model", ""))
        hashes = block_hashes(toks, block_size, seed_hash(model))
        if len(toks) % block_size:  # name the partial tail too, chained to the prefix
            hashes.append(hash((hashes[-1] if hashes else 0, tuple(toks[len(hashes) * block_size:]))))
        max_out = body.get("max_completion_tokens", body.get("max_tokens", 0)) or 0
        out.append(TraceRequest(
            timestamp_s=float(ts),
            input_length=len(toks),
            output_length=int(max_out) if isinstance(max_out, int) else 0,
            hash_ids=hashes,
            block_size=block_size,
            session_id=str(obj["session_id"]) if "session_id" in obj else None,
            body=body,
            endpoint=endpoint,
        ))
    return out


def sniff(obj: dict[str, Any]) -> str:
    """The format of one record."""
    if "chat_id" in obj:
        return "bailian"
    if "hash_ids" in obj and "input_length" in obj:
        return "mooncake"
    if "body" in obj or "messages" in obj or "prompt" in obj:
        return "openai"
    raise TraceFormatError("unknown trace format (expected Mooncake, Bailian-style or OpenAI-body JSONL)")


def load_trace(path: str | Path, fmt: str = "auto", block_size: int | None = None,
               limit: int | None = None, warn: Callable[[str], None] | None = None) -> list[TraceRequest]:
    """Read a trace file (first ``limit`` records when given). ``block_size`` defaults to
    the format's own (Mooncake: the records' ``block_size`` field, else 512; Bailian 16;
    OpenAI bodies 16). When hash ids and input lengths disagree (:func:`check_lengths`),
    ``warn`` gets one line (default: printed to stderr)."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        lines = []
        for line in f:
            if line.strip():
                lines.append(line)
                if limit is not None and len(lines) >= limit:
                    break
    if fmt == "auto":
        if not lines:
            return []
        try:
            first = json.loads(lines[0])
        except json.JSONDecodeError:
            raise TraceFormatError(f"{path}:1: not JSON") from None
        if not isinstance(first, dict):
            raise TraceFormatError(f"{path}:1: expected a JSON object")
        fmt = sniff(first)
    src = str(path)
    if fmt in ("mooncake", "bailian"):
        reqs = (parse_mooncake(lines, block_size, src) if fmt == "mooncake"
                else parse_bailian(lines, block_size or 16, src))
        msg = check_lengths(reqs, src)
        if msg is not None:
            (warn or (lambda m: print(m, file=sys.stderr)))(msg)
        return reqs
    if fmt == "openai":
        return parse_openai(lines, block_size or 16, src)
    raise TraceFormatError(f"unknown format {fmt!r}; known: auto, {', '.join(FORMATS)}")


def to_mooncake_line(r: TraceRequest) -> str:
    """One request as a Mooncake JSONL line (timestamp in integer ms), with the extra
    ``block_size`` field that :func:`parse_mooncake` reads (other tools ignore it)."""
    return json.dumps({"timestamp": int(round(r.timestamp_s * 1000)), "input_length": r.input_length,
                       "output_length": r.output_length, "hash_ids": r.hash_ids, "block_size": r.block_size})


def write_mooncake(requests: Iterable[TraceRequest], path: str | Path) -> int:
    """Write requests as Mooncake JSONL; returns the number written."""
    n = 0
    with Path(path).open("w", encoding="utf-8") as f:
        for r in requests:
            f.write(to_mooncake_line(r) + "\n")
            n += 1
    return n
