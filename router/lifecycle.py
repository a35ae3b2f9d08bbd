"""Process lifecycle of ``kvrouter serve``: graceful drain on SIGTERM, config reload on SIGHUP.

SIGTERM / SIGINT (drain):
  1. ``/ready`` answers 503 at once (a load balancer or Kubernetes takes the router out);
  2. for ``lifecycle.drain_delay_s`` the router keeps serving new requests (the time an
     endpoints controller needs to notice; 0 by default);
  3. the listening socket is closed, idle keep-alive connections are closed, and requests
     in flight (streams included) may finish for up to ``lifecycle.shutdown_grace_s``;
     whatever is still running then is cancelled;
  4. the process exits 0. A second signal during the drain cuts it short.

SIGHUP (reload): the config is read again from the same sources (file, ``KVROUTER_*`` env,
flags). An invalid config is refused with one log line and the running one stays. A valid
one applies what can change without a restart — the replica list and discovery settings
(new replicas are probed before use, removed ones drained, see ``Pool.set_replicas``), the
policy and its options (weights), client and admin keys, the lifecycle settings — and logs
a warning for sections that take effect only on restart (listen, models, index, health,
scrape, upstream, limits, ...: every other section). Requests in flight are not touched.
With ``lifecycle.watch_config_s`` > 0 the file is also polled and reloaded when it changes.

Metrics: ``kvrouter_config_reloads_total``, ``kvrouter_config_reload_failures_total``,
``kvrouter_draining`` (1 while draining). :func:`plan_reload` is pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge

from router.config import Config, ConfigError, check_policy
from router.core.scheduler import default_registry

if TYPE_CHECKING:
    from router.server import RouterState, Server

log = logging.getLogger("kvrouter.lifecycle")

RELOADABLE = ("policy", "auth", "replicas", "discovery", "lifecycle")
# every other section of the config (listen, models, index, health, scrape, upstream, limits, ...)
RESTART_SECTIONS = tuple(f.name for f in dataclasses.fields(Config) if f.name not in RELOADABLE)

Loader = Callable[[], Config]


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    """What a reload changes (pure comparison of two configs)."""

    policy: bool
    auth: bool
    membership: bool
    lifecycle: bool
    restart_only: tuple[str, ...]

    @property
    def changed(self) -> bool:
        return self.policy or self.auth or self.membership or self.lifecycle

    def describe(self) -> str:
        parts = [n for n in ("policy", "auth", "membership", "lifecycle") if getattr(self, n)]
        return ", ".join(parts) or "nothing"


def plan_reload(old: Config, new: Config) -> ReloadPlan:
    return ReloadPlan(
        policy=old.policy != new.policy,
        auth=old.auth != new.auth,
        membership=old.replicas != new.replicas or old.discovery != new.discovery,
        lifecycle=old.lifecycle != new.lifecycle,
        restart_only=tuple(s for s in RESTART_SECTIONS if getattr(old, s) != getattr(new, s)),
    )


class LifecycleMetrics:
    def __init__(self, registry: Any) -> None:
        self.reloads = Counter("kvrouter_config_reloads", "Config reloads applied (SIGHUP or file change)",
                               registry=registry)
        self.failures = Counter("kvrouter_config_reload_failures", "Config reloads refused (invalid config)",
                                registry=registry)
        self.draining = Gauge("kvrouter_draining", "1 while the router drains before exiting", registry=registry)


async def apply_config(st: RouterState, new: Config) -> ReloadPlan:
    """Apply ``new`` to a running router; raises ConfigError (and changes nothing) when invalid."""
    from router.proxy import NullPrefixService

    check_policy(new)
    if new.discovery.mode == "static" and not new.replicas:
        raise ConfigError("replicas", "at least one replica is required")
    plan = plan_reload(st.config, new)
    policy = None
    if plan.policy:
        policy = default_registry().create(new.policy.name, new.policy.options)
        if getattr(policy, "needs_prefix", False) and isinstance(st.prefix, NullPrefixService):
            raise ConfigError("policy.name", f"{new.policy.name} needs the prefix index, which this process "
                                             "did not start: restart to switch to it")
    # valid: apply
    if policy is not None:
        st.policy = policy
        px = st.proxy
        px.policy = policy
        px.policy_name = getattr(policy, "name", new.policy.name)
        px.needs_prefix = bool(getattr(policy, "needs_prefix", False))
        px._on_routed = getattr(policy, "on_routed", None)
        px._on_finished = getattr(policy, "on_finished", None)
        st.session_header = str(new.policy.options.get("session_header", "x-session-id"))
    if plan.auth:
        st._keys = [k.encode() for k in new.auth.api_keys]
        st._admin = new.auth.admin_key.encode() if new.auth.admin_key else None
    st.config = dataclasses.replace(st.config, policy=new.policy, auth=new.auth, replicas=new.replicas,
                                    discovery=new.discovery, lifecycle=new.lifecycle)
    if plan.membership:
        added, removed = await st.discovery.apply(st.config)
        log.info("config reload: replicas added %s, removed %s", added, removed)
        apply_events = getattr(st.prefix, "apply_events", None)
        if apply_events is not None:  # replicas' kv_events (docs/kv-events.md)
            await apply_events(st.config)
    st.configured_models = st.config.model_names()
    for section in plan.restart_only:
        log.warning("config reload: section %r changed; it takes effect on restart only", section)
    return plan


class Lifecycle:
    """Drain and reload for one started :class:`~router.server.Server`.

    ``loader`` re-reads the config (None: reloads are refused); ``watch_path`` is the file
    polled when ``lifecycle.watch_config_s`` > 0."""

    def __init__(self, server: Server, loader: Loader | None = None, watch_path: str | None = None) -> None:
        self.server = server
        self.state = server.state
        self.loader = loader
        self.watch_path = watch_path
        self.metrics = LifecycleMetrics(self.state.registry)
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def reload(self) -> bool:
        """Re-read and apply the config; False (old config kept) when it is invalid."""
        async with self._lock:
            if self.loader is None:
                log.error("config reload refused: this router was not started from a config file")
                self.metrics.failures.inc()
                return False
            try:
                new = self.loader()
                plan = await apply_config(self.state, new)
            except ConfigError as exc:
                log.error("config reload refused: %s; keeping the running config", exc)
                self.metrics.failures.inc()
                return False
            except Exception as exc:  # never let a reload take the router down
                log.exception("config reload refused: %s; keeping the running config", exc)
                self.metrics.failures.inc()
                return False
            self.metrics.reloads.inc()
            log.info("config reloaded (changed: %s)", plan.describe())
            return True

    def request_reload(self) -> None:
        self._spawn(self.reload())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def start_watch(self) -> None:
        if self.watch_path:
            self._spawn(self._watch(self.watch_path))

    async def _watch(self, path: str) -> None:
        def stamp() -> tuple[int, int, int] | None:
            try:
                s = os.stat(path)
            except OSError:
                return None
            return (s.st_mtime_ns, s.st_size, s.st_ino)

        last = stamp()
        while True:
            every = self.state.config.lifecycle.watch_config_s
            await asyncio.sleep(every or 1.0)
            if not every:
                continue
            now = stamp()
            if now is not None and now != last:
                # an editor may still be writing: reload once the file has stopped changing
                settle = min(every, 0.2)
                while True:
                    await asyncio.sleep(settle)
                    again = stamp()
                    if again == now:
                        break
                    now = again
                last = now
                if now is None:
                    continue
                log.info("config file %s changed: reloading", path)
                await self.reload()

    async def drain(self) -> None:
        """Fail /ready, keep serving for drain_delay_s, stop accepting, let in-flight finish."""
        lc = self.state.config.lifecycle
        self.state.draining = True
        self.metrics.draining.set(1)
        log.info("draining: /ready now fails; in flight %d; grace %.1fs", self.state.active, lc.shutdown_grace_s)
        for t in list(self._tasks):
            t.cancel()
        if lc.drain_delay_s > 0:
            await asyncio.sleep(lc.drain_delay_s)
        self.server.runner._shutdown_timeout = lc.shutdown_grace_s  # a reload may have changed it
        await self.server.stop()
        log.info("drained; exiting")


async def serve(config: Config, *, on_ready: Callable[[Server], Any] | None = None,
                loader: Loader | None = None, watch_path: str | None = None) -> None:
    """Serve ``config`` until SIGTERM/SIGINT (then drain); SIGHUP reloads through ``loader``."""
    from router.server import Server

    loop = asyncio.get_running_loop()
    server = await Server(config).start()
    lc = Lifecycle(server, loader, watch_path)
    stop = asyncio.Event()
    force = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            log.warning("second signal: ending the drain now")
            force.set()
        stop.set()

    installed: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(NotImplementedError, ValueError, RuntimeError):
            loop.add_signal_handler(sig, lc.request_reload if sig == signal.SIGHUP else on_signal)
            installed.append(sig)
    try:
        if on_ready is not None:
            on_ready(server)
        lc.start_watch()
        await stop.wait()
    finally:
        with contextlib.suppress(NotImplementedError, ValueError, RuntimeError):
            loop.remove_signal_handler(signal.SIGHUP)
        drain = asyncio.create_task(lc.drain())
        forced = asyncio.create_task(force.wait())
        await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        if not drain.done():
            drain.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await drain
        for sig in installed:
            with contextlib.suppress(NotImplementedError, ValueError, RuntimeError):
                loop.remove_signal_handler(sig)
