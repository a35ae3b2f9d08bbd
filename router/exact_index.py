"""Exact and approximate tracking together: the index as the router's request path sees it.

When some replicas publish KV events, the router wraps its index in :class:`ExactAwareIndex`
(``ExactAwareIndex(index, subscriber)``) and keeps recording its own routing decisions
through it. Approximate entries bridge the time until the engine's event arrives; for a
replica whose events are followed, each approximate record is checked ``approx_ttl_s``
later and the blocks no engine event confirmed are removed. Events always win:
``BlockRemoved`` / ``AllBlocksCleared`` delete entries whatever wrote them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from router.config import Config
from router.events import EventSource, EventSubscriber

log = logging.getLogger("kvrouter.events")


class ExactAwareIndex:
    """The router's index as the request path sees it when some replicas publish events.

    Exact and approximate together: the router keeps recording its own routing decisions
    (approximate entries bridge the time until the engine's event arrives), and for a
    replica whose events are followed each such record is checked ``approx_ttl_s`` later:
    blocks no engine event confirmed by then (the request never reached prefill, the engine
    tokenizes differently, ...) are removed. Events win: ``BlockRemoved`` and
    ``AllBlocksCleared`` delete entries whatever wrote them — except a ``BlockRemoved``
    whose batch is older (engine timestamp) than the router's own record of that block on
    that replica: the eviction predates the routing decision, the request just sent will
    compute and store the block again, so the removal is stale and skipped (the block is
    still removed by the check above if no ``BlockStored`` confirms it). Engine and router
    clocks must agree to well under a second for this. Everything else is delegated.
    """

    def __init__(self, inner: Any, subscriber: EventSubscriber, *, approx_ttl_s: float = 30.0,
                 sweep_interval_s: float = 1.0, max_pending: int = 100_000,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.inner = inner
        self.subscriber = subscriber
        subscriber.removal_filter = self.fresh_removals
        self.approx_ttl_s = approx_ttl_s
        self.sweep_interval_s = sweep_interval_s
        self.clock = clock
        self.wall = wall
        self._recorded: dict[str, dict[int, float]] = {}  # replica -> block -> wall time of last record
        self.expired_blocks = 0  # approximate blocks removed for want of confirmation
        self._pending: deque[tuple[float, str, tuple[int, ...]]] = deque(maxlen=max_pending)
        self._task: asyncio.Task[None] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def start(self) -> None:
        """Starts the inner index, the subscriber and the confirmation sweep."""
        await self.inner.start()
        await self.subscriber.start()
        if self._task is None:
            self._task = asyncio.create_task(self._sweeper())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        await self.subscriber.close()
        await self.inner.close()

    async def lookup(self, model: str, hashes: Sequence[int]) -> dict[str, int]:
        return await self.inner.lookup(model, hashes)

    def _note(self, hashes: Sequence[int], replica: str) -> None:
        if hashes and self.subscriber.follows(replica):
            self._pending.append((self.clock() + self.approx_ttl_s, replica, tuple(hashes)))
            rec = self._recorded.setdefault(replica, {})
            t = self.wall()
            for h in hashes:
                rec[h] = t

    def fresh_removals(self, replica: str, hashes: Sequence[int], engine_ts: float) -> list[int]:
        """The blocks of an engine eviction batch (timestamp ``engine_ts``) to remove: all but
        those the router recorded on ``replica`` after the eviction happened."""
        rec = self._recorded.get(replica)
        if not rec:
            return list(hashes)
        return [h for h in hashes if rec.get(h, float("-inf")) <= engine_ts]

    def record_nowait(self, model: str, hashes: Sequence[int], replica: str) -> None:
        self.inner.record_nowait(model, hashes, replica)
        self._note(hashes, replica)

    async def record(self, model: str, hashes: Sequence[int], replica: str) -> None:
        await self.inner.record(model, hashes, replica)
        self._note(hashes, replica)

    async def remove(self, replica: str, hashes: Sequence[int]) -> None:
        await self.inner.remove(replica, hashes)

    async def clear(self, replica: str) -> None:
        """The router dropped the replica (ejected, left the pool): clear it, and make the
        subscriber start over for it (its next event triggers a clear and a full replay)."""
        await self.inner.clear(replica)
        if self.subscriber.follows(replica):
            await self.subscriber.reset_replica(replica, "router")

    async def sweep(self, now: float | None = None) -> int:
        """Remove approximate blocks whose confirmation window ended unconfirmed."""
        now = self.clock() if now is None else now
        removed = 0
        pend = self._pending
        while pend and pend[0][0] <= now:
            _, replica, hashes = pend.popleft()
            rec = self._recorded.get(replica)
            if rec:
                old = self.wall() - self.approx_ttl_s
                for h in hashes:
                    if rec.get(h, old) <= old:
                        rec.pop(h, None)
            if not self.subscriber.follows(replica):
                continue
            tracker = self.subscriber.tracker(replica)
            stale = [h for h in hashes if not tracker.holds(h)]
            if stale:
                await self.inner.remove(replica, stale)
                removed += len(stale)
                self.subscriber.metrics.approx_expired.labels(replica).inc(len(stale))
        self.expired_blocks += removed
        return removed

    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                await self.sweep()
            except Exception as exc:
                log.warning("kv events: approximate-entry sweep failed: %s", exc)


def event_sources(config: Config) -> list[EventSource]:
    """One source per replica with ``kv_events`` (model: its first; block size: that model's)."""
    out = []
    for rep in config.replicas:
        ev = rep.kv_events
        if ev is None:
            continue
        model = rep.models[0]
        out.append(EventSource(rep.id, model, config.model(model).block_size, ev.endpoint,
                               ev.replay_endpoint, ev.topic, ev.bind))
    return out


def attach_events(config: Config, index: Any, registry: CollectorRegistry | None = None, *,
                  approx_ttl_s: float = 30.0) -> tuple[Any, EventSubscriber | None]:
    """``(index_for_the_router, subscriber)``: when some replica has ``kv_events``, the
    router's index wrapped in :class:`ExactAwareIndex` (its ``start``/``close`` run the
    subscriber too) and the subscriber writing into ``index``; else ``(index, None)``."""
    sources = event_sources(config)
    if not sources:
        return index, None
    sub = EventSubscriber(sources, index, registry=registry)
    return ExactAwareIndex(index, sub, approx_ttl_s=approx_ttl_s), sub
