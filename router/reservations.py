"""Shared load accounting: in-flight counts per replica shared by router processes via Redis.

Several router processes (``kvrouter serve --workers N``, or router instances on several
machines) that each count only their own in-flight requests all see the same replica as
"least loaded" and pile onto it. With ``shared_load.enabled`` each process runs one
:class:`SharedLoad` task that, every ``shared_load.interval_s`` (20 ms by default):

1. publishes its own counts (``ReplicaState.in_flight`` of the pool, kept exact by the
   in-flight guards of :mod:`router.pool`) as one hash, with expiry ``ttl_s``;
2. reads the sum of every OTHER live process's counts in the same script, and
3. writes them into ``ReplicaState.reserved``, which ``ReplicaState.load`` adds to the
   process's own ``in_flight`` — so every policy that reads ``load`` sees the fleet-wide count.

One ``EVALSHA`` per interval and per process, never per request: the request path costs
nothing more (the lag is one interval plus one round trip). A process that crashes stops
refreshing: its hash expires and its members entry is pruned after ``ttl_s``, so its
reservations vanish by themselves. A clean shutdown deletes them at once.

Keys (one hash tag, so the script runs on one Redis Cluster node)::

    <ns>:{load}:procs      sorted set  process id -> expiry time (ms, Redis clock)
    <ns>:{load}:p:<id>     hash        replica id -> in-flight count (non-zero only)

Redis down: the last totals are kept for ``ttl_s``, then dropped (each process balances
on its own counts), and syncing resumes when Redis answers. :func:`parse_totals` and
:func:`apply_reserved` are pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from router.core.types import ReplicaState
from router.index.cluster import ClusterConnections, SingleConnection, connections
from router.index.resp import RespError

log = logging.getLogger("kvrouter.shared_load")

SYNC_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me, ttl, kp = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local procs = KEYS[1]
redis.call('ZREMRANGEBYSCORE', procs, '-inf', now)
local mine = kp .. me
redis.call('DEL', mine)
if ttl > 0 then
  redis.call('ZADD', procs, now + ttl, me)
  redis.call('PEXPIRE', procs, ttl * 2)
  if #ARGV > 3 then
    redis.call('HSET', mine, unpack(ARGV, 4))
    redis.call('PEXPIRE', mine, ttl)
  end
else
  redis.call('ZREM', procs, me)
end
local totals, order = {}, {}
for _, p in ipairs(redis.call('ZRANGE', procs, 0, -1)) do
  if p ~= me then
    local all = redis.call('HGETALL', kp .. p)
    for j = 1, #all, 2 do
      local r = all[j]
      if not totals[r] then order[#order + 1] = r; totals[r] = 0 end
      totals[r] = totals[r] + tonumber(all[j + 1])
    end
  end
end
local out = {}
for _, r in ipairs(order) do out[#out + 1] = r; out[#out + 1] = totals[r] end
return out
"""
SYNC_SHA = hashlib.sha1(SYNC_LUA.encode()).hexdigest().encode()


def parse_totals(raw: Sequence[Any]) -> dict[str, float]:
    """The script's flat ``[replica, count, ...]`` reply → replica → count."""
    out: dict[str, float] = {}
    for i in range(0, len(raw) - 1, 2):
        k = raw[i].decode() if isinstance(raw[i], bytes) else str(raw[i])
        out[k] = float(raw[i + 1])
    return out


def own_counts(states: Sequence[ReplicaState]) -> list[bytes | str | int]:
    """This process's non-zero in-flight counts as flat HSET arguments."""
    out: list[bytes | str | int] = []
    for s in states:
        if s.in_flight > 0:
            out.append(s.id)
            out.append(s.in_flight)
    return out


def apply_reserved(states: Sequence[ReplicaState], totals: dict[str, float]) -> None:
    """Set each replica's ``reserved`` to the other processes' count (0 when absent)."""
    for s in states:
        s.reserved = totals.get(s.id, 0.0)


def process_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"


class SharedLoad:
    """The sync task of one router process (see module docstring)."""

    def __init__(self, url: str, states: Callable[[], Sequence[ReplicaState]], *,
                 namespace: str = "kvrouter", interval_s: float = 0.02, ttl_s: float = 2.0,
                 cluster: bool = False, timeout_s: float = 0.5, proc_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.states = states
        self.interval_s = interval_s
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.proc_id = proc_id or process_id()
        self.procs_key = f"{namespace}:{{load}}:procs"
        self.prefix = f"{namespace}:{{load}}:p:"
        self.conns: ClusterConnections | SingleConnection = connections(url, cluster, timeout_s)
        self.clock = clock
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._last_ok = clock()
        self.up = True
        self.syncs = 0
        self.failures = 0
        self.totals: dict[str, float] = {}

    async def start(self) -> None:
        if self._task is None:
            with contextlib.suppress(Exception):
                await self.sync()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="shared-load")

    async def close(self) -> None:
        if self._task is not None:
            self._closing = True
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=5.0)
            self._task = None
        with contextlib.suppress(Exception):  # leave at once rather than after ttl
            await self._run(0, [])
        self.conns.close()

    async def _loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed(exc)

    async def sync(self) -> dict[str, float]:
        """Publish own counts, read the others' totals, apply them; returns the totals."""
        states = self.states()
        raw = await self._run(self.ttl_ms, own_counts(states))
        self.totals = parse_totals(raw)
        apply_reserved(states, self.totals)
        self.syncs += 1
        self._last_ok = self.clock()
        if not self.up:
            self.up = True
            log.warning("shared load: Redis reachable again; balancing on fleet-wide counts")
        return self.totals

    async def _run(self, ttl_ms: int, counts: list[bytes | str | int]) -> list[Any]:
        args: tuple[bytes | str | int, ...] = (b"1", self.procs_key, self.proc_id, ttl_ms, self.prefix, *counts)
        key = self.procs_key
        try:
            raw = await self.conns.call(key, b"EVALSHA", SYNC_SHA, *args)
            if isinstance(raw, RespError) and str(raw).startswith("NOSCRIPT"):
                raw = await self.conns.call(key, b"EVAL", SYNC_LUA, *args)
        except Exception:
            self.conns.drop(key)
            raise
        if isinstance(raw, RespError):
            raise raw
        return list(raw or [])

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        if self.up:
            self.up = False
            log.warning("shared load: Redis unreachable (%s); balancing on this process's counts after %.1fs",
                        exc.__class__.__name__, self.ttl_ms / 1000)
        if self.clock() - self._last_ok > self.ttl_ms / 1000:
            self.totals = {}
            apply_reserved(self.states(), {})


class SharedLoadCollector:
    """Prometheus view of one :class:`SharedLoad`, read at scrape time."""

    def __init__(self, shared: SharedLoad) -> None:
        self.shared = shared

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        sh = self.shared
        up = GaugeMetricFamily("kvrouter_shared_load_up", "1 when the last shared-load sync succeeded")
        up.add_metric([], 1.0 if sh.up else 0.0)
        syncs = CounterMetricFamily("kvrouter_shared_load_syncs", "Shared-load syncs completed")
        syncs.add_metric([], sh.syncs)
        fails = CounterMetricFamily("kvrouter_shared_load_sync_failures", "Shared-load syncs that failed")
        fails.add_metric([], sh.failures)
        res = GaugeMetricFamily("kvrouter_replica_reserved", "In-flight requests on the replica from OTHER "
                                "router processes (shared load)", labels=["replica"])
        for s in sh.states():
            res.add_metric([s.id], s.reserved)
        return [up, syncs, fails, res]


def build_shared_load(config: Any, states: Callable[[], Sequence[ReplicaState]],
                      registry: Any = None) -> SharedLoad | None:
    """A :class:`SharedLoad` from ``config.shared_load`` (None when disabled); its metrics are
    registered on ``registry`` when given."""
    sl = config.shared_load
    if not sl.enabled:
        return None
    url = sl.url or config.index.url
    cluster = config.index.cluster if sl.cluster is None else sl.cluster
    shared = SharedLoad(url, states, namespace=sl.namespace, interval_s=sl.interval_s, ttl_s=sl.ttl_s,
                        cluster=bool(cluster))
    if registry is not None:
        registry.register(SharedLoadCollector(shared))
    return shared
