"""The replica pool: membership, health checks, ejection and re-admission, the in-flight
guard, and engine load scraped from each replica's ``/metrics``.

Each replica has one :class:`~router.core.types.ReplicaState` that is updated in place by
the health and scrape loops and by in-flight guards; ``snapshot(model)`` returns a cached
list of those objects, so the per-request cost does not grow with the fleet beyond what the
policy itself does. The health state machine (:class:`HealthTracker`) is pure; the loops
around it do the I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import aiohttp

from backends.engines import EngineLoad, parse_load
from router.config import HealthConfig, ReplicaConfig, ScrapeConfig
from router.core.types import ReplicaState

log = logging.getLogger("kvrouter.pool")


@dataclass(slots=True)
class HealthTracker:
    """Consecutive failures eject, consecutive successes re-admit. Pure."""

    failure_threshold: int
    success_threshold: int
    healthy: bool = True
    fails: int = 0
    oks: int = 0

    def observe(self, ok: bool, *, force_eject: bool = False) -> bool:
        """Record one check; returns True when ``healthy`` changed."""
        if ok:
            self.fails = 0
            self.oks += 1
            if not self.healthy and self.oks >= self.success_threshold:
                self.healthy = True
                return True
            return False
        self.oks = 0
        self.fails += 1
        if self.healthy and (force_eject or self.fails >= self.failure_threshold):
            self.healthy = False
            return True
        return False


class Guard:
    """One request's hold on a replica's in-flight count. Released exactly once, however the
    request ends (use as a context manager or call :meth:`release` in a ``finally``)."""

    __slots__ = ("_state", "_done")

    def __init__(self, state: ReplicaState) -> None:
        self._state = state
        self._done = False
        state.in_flight += 1

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._state.in_flight -= 1

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(slots=True)
class Replica:
    """A replica's config, its live state, and what the checks last saw."""

    cfg: ReplicaConfig
    state: ReplicaState
    tracker: HealthTracker
    auth_headers: dict[str, str] = field(default_factory=dict)
    load: EngineLoad | None = None
    last_error: str = ""
    last_check: float = 0.0
    last_scrape: float = 0.0
    ejections: int = 0


class Pool:
    """The replicas of one router process.

    ``on_removed(replica_id)`` is called when a replica leaves the pool or is ejected (its
    KV cache is presumed lost); ``on_health(replica_id, healthy)`` on every transition;
    ``on_left(config)`` when a replica leaves the pool (not on ejection).
    """

    def __init__(
        self,
        replicas: Iterable[ReplicaConfig],
        health: HealthConfig,
        scrape: ScrapeConfig,
        *,
        on_removed: Callable[[str], None] | None = None,
        on_health: Callable[[str, bool], None] | None = None,
        on_left: Callable[[ReplicaConfig], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.on_left = on_left
        self.health_cfg = health
        self.scrape_cfg = scrape
        self.on_removed = on_removed
        self.on_health = on_health
        self.clock = clock
        self._replicas: dict[str, Replica] = {}
        self._by_model: dict[str, list[ReplicaState]] = {}
        self._all: list[ReplicaState] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        for rc in replicas:
            self._insert(rc)
        self._rebuild()

    # ------------------------------------------------------------------ membership

    def _insert(self, rc: ReplicaConfig) -> Replica:
        state = ReplicaState(id=rc.id, url=rc.url, models=rc.models, capacity_blocks=rc.capacity_blocks)
        rep = Replica(cfg=rc, state=state,
                      tracker=HealthTracker(self.health_cfg.failure_threshold, self.health_cfg.success_threshold),
                      auth_headers={"Authorization": f"Bearer {rc.api_key}"} if rc.api_key else {})
        self._replicas[rc.id] = rep
        return rep

    def _rebuild(self) -> None:
        by_model: dict[str, list[ReplicaState]] = {}
        for rep in self._replicas.values():
            for m in rep.cfg.models:
                by_model.setdefault(m, []).append(rep.state)
        self._by_model = by_model
        self._all = [r.state for r in self._replicas.values()]

    def add(self, rc: ReplicaConfig) -> Replica:
        if rc.id in self._replicas:
            raise ValueError(f"replica {rc.id!r} already in the pool")
        rep = self._insert(rc)
        self._rebuild()
        return rep

    def remove(self, replica_id: str) -> bool:
        rep = self._replicas.pop(replica_id, None)
        if rep is None:
            return False
        rep.state.healthy = False  # requests still holding its state see it gone
        self._rebuild()
        if self.on_removed:
            self.on_removed(replica_id)
        if self.on_left:
            self.on_left(rep.cfg)
        return True

    async def set_replicas(self, desired: Sequence[ReplicaConfig]) -> tuple[list[str], list[str]]:
        """Make the membership ``desired`` (discovery, config reload); returns (added, removed) ids.

        New replicas join out of rotation and are health-checked before use (when the pool is
        started). Replicas that left stop receiving requests at once while the requests they
        already hold finish (their guards keep the state object), and ``on_removed`` drops
        their index entries. A changed ``url`` or ``models`` replaces the replica; a changed
        ``api_key`` or ``capacity_blocks`` is applied in place."""
        want = {rc.id: rc for rc in desired}
        removed = [rid for rid, rep in self._replicas.items()
                   if rid not in want or (rep.cfg.url, rep.cfg.models) != (want[rid].url, want[rid].models)]
        for rid in removed:
            self.remove(rid)
        added: list[Replica] = []
        for rc in desired:
            rep = self._replicas.get(rc.id)
            if rep is None:
                rep = self._insert(rc)
                rep.tracker.healthy = rep.state.healthy = False  # probed before use
                added.append(rep)
            elif rep.cfg != rc:
                rep.cfg = rc
                rep.auth_headers = {"Authorization": f"Bearer {rc.api_key}"} if rc.api_key else {}
                if rc.capacity_blocks is not None:
                    rep.state.capacity_blocks = rc.capacity_blocks
        self._rebuild()
        if added:
            log.info("replicas added: %s; removed: %s", [r.cfg.id for r in added], removed)
            if self._session is not None:
                await asyncio.gather(*(self.check_one(r) for r in added))
        elif removed:
            log.info("replicas removed: %s", removed)
        return [r.cfg.id for r in added], removed

    # ------------------------------------------------------------------ reads

    def snapshot(self, model: str) -> list[ReplicaState]:
        """The replicas serving ``model`` (cached list of live objects; do not mutate)."""
        return self._by_model.get(model, [])

    def all_states(self) -> list[ReplicaState]:
        return self._all

    def replicas(self) -> list[Replica]:
        return list(self._replicas.values())

    def get(self, replica_id: str) -> Replica | None:
        return self._replicas.get(replica_id)

    def models(self) -> list[str]:
        return list(self._by_model)

    def healthy_models(self) -> list[str]:
        return [m for m, states in self._by_model.items() if any(s.healthy for s in states)]

    def has_model(self, model: str) -> bool:
        return model in self._by_model

    def acquire(self, replica_id: str) -> Guard:
        return Guard(self._replicas[replica_id].state)

    # ------------------------------------------------------------------ health

    def _set_health(self, rep: Replica, ok: bool, error: str = "", force_eject: bool = False) -> None:
        rep.last_error = "" if ok else error
        if rep.tracker.observe(ok, force_eject=force_eject):
            rep.state.healthy = rep.tracker.healthy
            if rep.tracker.healthy:
                log.info("replica %s re-admitted", rep.cfg.id)
            else:
                rep.ejections += 1
                log.warning("replica %s ejected: %s", rep.cfg.id, error or "unhealthy")
                rep.state.running = rep.state.waiting = rep.state.kv_usage = 0.0
            if self.on_health:
                self.on_health(rep.cfg.id, rep.tracker.healthy)
            if not rep.tracker.healthy and self.on_removed:
                self.on_removed(rep.cfg.id)

    def report_connect_error(self, replica_id: str, error: str) -> None:
        """Passive check from the proxy: a connection to the replica failed."""
        rep = self._replicas.get(replica_id)
        if rep is not None:
            self._set_health(rep, False, f"connect error: {error}",
                             force_eject=self.health_cfg.eject_on_connect_error)

    async def check_one(self, rep: Replica) -> bool:
        assert self._session is not None
        url = rep.cfg.url + self.health_cfg.path
        try:
            async with self._session.get(url, headers=rep.auth_headers,
                                         timeout=aiohttp.ClientTimeout(total=self.health_cfg.timeout_s)) as r:
                await r.read()
                ok, err = r.status == 200, f"health status {r.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            ok, err = False, f"{type(exc).__name__}: {exc}"
        rep.last_check = self.clock()
        self._set_health(rep, ok, err)
        return ok

    async def check_all(self) -> None:
        reps = list(self._replicas.values())
        if reps:
            await asyncio.gather(*(self.check_one(r) for r in reps))

    async def scrape_one(self, rep: Replica) -> None:
        assert self._session is not None
        if not rep.state.healthy:
            return
        url = rep.cfg.url + self.scrape_cfg.path
        try:
            async with self._session.get(url, headers=rep.auth_headers,
                                         timeout=aiohttp.ClientTimeout(total=self.scrape_cfg.timeout_s)) as r:
                text = await r.text(errors="replace") if r.status == 200 else ""
        except (TimeoutError, aiohttp.ClientError, OSError, UnicodeError):
            text = ""
        load = parse_load(text) if text else EngineLoad()
        self.apply_load(rep, load)

    def apply_load(self, rep: Replica, load: EngineLoad) -> None:
        rep.load = load
        rep.last_scrape = self.clock()
        st = rep.state
        st.running, st.waiting, st.kv_usage = load.running, load.waiting, load.kv_usage
        if rep.cfg.capacity_blocks is None and load.num_blocks:
            st.capacity_blocks = load.num_blocks

    async def scrape_all(self) -> None:
        reps = list(self._replicas.values())
        if reps:
            await asyncio.gather(*(self.scrape_one(r) for r in reps))

    # ------------------------------------------------------------------ lifecycle

    async def start(self, *, initial_check: bool = True) -> None:
        """Open the checker's connection pool, run one health round (a replica down at start
        is ejected at once), then start the periodic loops."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=64, limit_per_host=4), auto_decompress=True)
        if initial_check:
            for rep in self._replicas.values():
                rep.tracker.failure_threshold = 1
            await self.check_all()
            for rep in self._replicas.values():
                rep.tracker.failure_threshold = self.health_cfg.failure_threshold
            if self.scrape_cfg.enabled:
                await self.scrape_all()
        self._tasks.append(asyncio.create_task(self._loop(self.check_all, self.health_cfg.interval_s)))
        if self.scrape_cfg.enabled:
            self._tasks.append(asyncio.create_task(self._loop(self.scrape_all, self.scrape_cfg.interval_s)))

    async def _loop(self, fn: Callable[[], object], interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await fn()  # type: ignore[misc]
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one round must not stop the loop
                log.exception("pool loop %s failed", getattr(fn, "__name__", fn))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None


def replica_from_dict(d: dict[str, object]) -> ReplicaConfig:
    """Validate one replica given as a mapping (admin API), with the config's messages."""
    from router.config import Config

    return Config.from_dict({"replicas": [d]}).replicas[0]


def states_summary(states: Sequence[ReplicaState]) -> list[dict[str, object]]:
    return [{"id": s.id, "url": s.url, "models": list(s.models), "healthy": s.healthy,
             "in_flight": s.in_flight, "running": s.running, "waiting": s.waiting,
             "kv_usage": s.kv_usage} for s in states]
