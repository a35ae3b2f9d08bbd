"""Exact and approximate tracking together: the index as the router's request path sees it.

When some replicas publish KV events, the router wraps its index in :class:`ExactAwareIndex`
(``ExactAwareIndex(index, subscriber)``) and keeps recording its own routing decisions
through it. Approximate entries bridge the time until the engine's event arrives; for a
replica whose events are followed, each approximate record is checked ``approx_ttl_s``
later and the blocks no engine event confirmed are removed. Events always win:
``BlockRemoved`` / ``AllBlocksCleared`` delete entries whatever wrote them.

Capacity: for a followed replica the engine's evictions arrive as events, so the index's
per-replica LRU bound is only a backstop and must not evict blocks the engine still holds
(the router's own records and the event writes both count against it, and the Redis
index counts rewrites). It is set to ``exact_capacity(engine_blocks, floor)`` =
max(``EXACT_CAPACITY_FACTOR`` × the engine's blocks, ``index.capacity_blocks``).

Membership: ``remove_replica`` (the replica left the pool) stops following it and clears
it; ``sync_sources`` applies a reloaded config's ``kv_events`` (sources added, changed,
dropped).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from router.config import Config
from router.events import EventSource, EventSubscriber
from router.tasks import stop_task

log = logging.getLogger("kvrouter.events")


EXACT_CAPACITY_FACTOR = 8


def exact_capacity(engine_blocks: int, floor: int) -> int:
    """The index bound for a replica whose engine events are followed (see module doc)."""
    return max(EXACT_CAPACITY_FACTOR * engine_blocks, floor)


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
                 capacity_floor: int = 100_000, engine_capacities: Mapping[str, int] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.inner = inner
        self.subscriber = subscriber
        subscriber.removal_filter = self.fresh_removals
        self.approx_ttl_s = approx_ttl_s
        self.capacity_floor = capacity_floor
        self._engine_caps: dict[str, int] = {}  # replica -> engine blocks (config or scraped)
        for rid, blocks in (engine_capacities or {}).items():
            self.set_capacity(rid, blocks)
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
        await stop_task(self._task)
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

    def record_nowait(self, model: str, hashes: Sequence[int], replica: str, *, stored: bool = False) -> None:
        self.inner.record_nowait(model, hashes, replica, stored=stored)
        self._note(hashes, replica)

    async def record(self, model: str, hashes: Sequence[int], replica: str, *, stored: bool = False) -> None:
        await self.inner.record(model, hashes, replica, stored=stored)
        self._note(hashes, replica)

    async def remove(self, replica: str, hashes: Sequence[int]) -> None:
        await self.inner.remove(replica, hashes)

    def set_capacity(self, replica: str, blocks: int) -> None:
        """The engine holds ``blocks``: the bound itself for an approximate replica, the
        backstop ``exact_capacity`` for one whose events are followed."""
        self._engine_caps[replica] = blocks
        self._apply_capacity(replica)

    def _apply_capacity(self, replica: str) -> None:
        setter = getattr(self.inner, "set_capacity", None)
        if setter is None:
            return
        blocks = self._engine_caps.get(replica)
        if self.subscriber.follows(replica):
            setter(replica, exact_capacity(blocks or 0, self.capacity_floor))
        elif blocks:
            setter(replica, blocks)
        else:
            setter(replica, self.capacity_floor)

    async def remove_replica(self, replica: str) -> None:
        """The replica left the pool: stop following its events (they would rebuild its
        entries) and clear it. ``sync_sources`` (a reload listing it again) follows it anew."""
        await self.subscriber.remove_replica(replica)
        await self.inner.clear(replica)
        self._recorded.pop(replica, None)
        self._apply_capacity(replica)

    async def sync_sources(self, sources: Sequence[EventSource]) -> tuple[list[str], list[str]]:
        """Make the followed sources ``sources`` (config reload); ``(added, dropped)`` ids.
        A replica whose ``kv_events`` changed is followed from its new source; one whose
        ``kv_events`` disappeared is cleared and becomes approximate."""
        want = {s.replica: s for s in sources}
        dropped = [rid for rid in self.subscriber.replicas() if rid not in want]
        for rid in dropped:
            await self.subscriber.drop_source(rid)
            self._recorded.pop(rid, None)
            self._apply_capacity(rid)
        added = []
        for s in sources:
            if self.subscriber.source(s.replica) != s or not self.subscriber.follows(s.replica):
                await self.follow(s)
                added.append(s.replica)
        return added, dropped

    async def follow(self, source: EventSource) -> None:
        """Follow ``source`` (a replica added or re-added): cleared, rebuilt from the engine's
        replay buffer, bounded by ``exact_capacity``."""
        await self.subscriber.add_source(source)
        self._apply_capacity(source.replica)

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
                  approx_ttl_s: float | None = None,
                  always: bool = False) -> tuple[Any, EventSubscriber | None]:
    """``(index_for_the_router, subscriber)``: when some replica has ``kv_events`` (or
    ``always``), the router's index wrapped in :class:`ExactAwareIndex` (its
    ``start``/``close`` run the subscriber too) and the subscriber writing into ``index``;
    else ``(index, None)``. ``approx_ttl_s`` defaults to ``index.approx_ttl_s``."""
    sources = event_sources(config)
    if not sources and not always:
        return index, None
    sub = EventSubscriber(sources, index, registry=registry)
    ttl = config.index.approx_ttl_s if approx_ttl_s is None else approx_ttl_s
    caps = {r.id: r.capacity_blocks for r in config.replicas if r.capacity_blocks}
    wrapped = ExactAwareIndex(index, sub, approx_ttl_s=ttl, capacity_floor=config.index.capacity_blocks,
                              engine_capacities=caps)
    return wrapped, sub
