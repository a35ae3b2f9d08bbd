"""The prefix index's async interface, shared by the memory and Redis implementations.

Every router process talks to the index through :class:`IndexBackend`; the KV-events
subscriber writes through the same methods. Keys are chained block hashes
(:mod:`router.core.hashing`), already seeded by model, LoRA and cache salt.

Contract (tested by ``tests/contract/test_index_contract.py`` against both):
  * ``lookup(model, hashes)`` → replica → number of consecutive blocks, from the first,
    that the replica holds; replicas without a match are absent; ``{}`` when the index is
    unavailable (never raises).
  * ``record(model, hashes, replica)`` → the replica holds these blocks now; may be
    applied asynchronously (``flush()`` waits for pending writes).
  * ``remove(replica, hashes)`` / ``clear(replica)`` → the replica no longer holds them.
  * each replica holds at most its capacity in blocks, least recently used dropped first;
    an entry not re-recorded within the TTL disappears.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class IndexBackend(Protocol):
    async def start(self) -> None: ...

    async def lookup(self, model: str, hashes: Sequence[int]) -> dict[str, int]: ...

    async def record(self, model: str, hashes: Sequence[int], replica: str, *, stored: bool = False) -> None:
        """``stored``: the engine reports these blocks stored (a KV event): every one must be
        held afterwards, even one a removal took out of the middle of a recorded chain."""

    def record_nowait(self, model: str, hashes: Sequence[int], replica: str, *, stored: bool = False) -> None:
        """Queue a record from the request path (never blocks, never raises)."""

    async def remove(self, replica: str, hashes: Sequence[int]) -> None: ...

    async def clear(self, replica: str) -> None: ...

    def set_capacity(self, replica: str, blocks: int) -> None: ...

    async def flush(self) -> None: ...

    async def close(self) -> None: ...


class IndexEvents:
    """Callbacks an index reports through (metrics, logs); no-ops by default."""

    def availability(self, up: bool) -> None:
        """The index became reachable (True) or unreachable (False)."""

    def error(self, op: str) -> None:
        """One operation (lookup / record / remove / clear) failed or was dropped."""
