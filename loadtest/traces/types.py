"""The in-memory request type every trace format and generator produces.

A :class:`TraceRequest` is one request of a workload: when it arrives (seconds from the
start of the trace), how long its prompt and answer are in tokens, and the prompt's shape
as ``hash_ids`` — one id per block of ``block_size`` tokens (the last block may be
partial), prefix-chained as in the Mooncake and Bailian releases: the same id at the same
position means the same prompt up to the end of that block. Formats that carry a real
OpenAI request body keep it in ``body``. Plain data, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace (see the module docstring)."""

    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: list[int] = field(default_factory=list)
    block_size: int = 512
    session_id: str | None = None
    tenant: str | None = None
    body: dict[str, Any] | None = None
    endpoint: str = "completions"  # "completions" or "chat" (for ``body``)

    def block_tokens(self, i: int) -> int:
        """Tokens of the prompt that fall in block ``i`` (the last block may be partial)."""
        return max(0, min(self.block_size, self.input_length - i * self.block_size))


class TraceFormatError(ValueError):
    """A trace line that cannot be read (the message names the line)."""


def sort_by_time(requests: list[TraceRequest]) -> list[TraceRequest]:
    """Requests in arrival order (stable for equal timestamps), rebased to start at 0."""
    out = sorted(requests, key=lambda r: r.timestamp_s)
    if out and out[0].timestamp_s != 0:
        t0 = out[0].timestamp_s
        for r in out:
            r.timestamp_s -= t0
    return out
