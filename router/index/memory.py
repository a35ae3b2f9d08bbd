"""The embedded in-memory index: :class:`router.core.prefix_index.PrefixIndex` behind the
async interface, with the monotonic clock for TTLs. One per router process (not shared)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from router.core.prefix_index import PrefixIndex


class MemoryIndex:
    """Process-local prefix index (the default ``index.backend: memory``)."""

    def __init__(self, default_capacity: int = 100_000, capacities: Mapping[str, int] | None = None,
                 ttl_s: float | None = 3600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = PrefixIndex(default_capacity, capacities, ttl_s)
        self._clock = clock

    async def start(self) -> None:
        return None

    async def lookup(self, model: str, hashes: Sequence[int]) -> dict[str, int]:
        return self.index.lookup(hashes, self._clock())

    def record_nowait(self, model: str, hashes: Sequence[int], replica: str, *, stored: bool = False) -> None:
        self.index.record(hashes, replica, self._clock())

    async def record(self, model: str, hashes: Sequence[int], replica: str, *, stored: bool = False) -> None:
        self.index.record(hashes, replica, self._clock())

    async def remove(self, replica: str, hashes: Sequence[int]) -> None:
        self.index.remove(replica, hashes)

    async def clear(self, replica: str) -> None:
        self.index.clear(replica)

    def set_capacity(self, replica: str, blocks: int) -> None:
        self.index.set_capacity(replica, blocks)

    async def flush(self) -> None:
        return None

    async def close(self) -> None:
        return None
