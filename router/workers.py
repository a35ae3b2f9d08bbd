"""``kvrouter serve --workers N``: N router processes on one port, under a supervisor.

One Python process is one core. The supervisor (this module) starts N ordinary
``kvrouter serve`` processes with the same config sources plus::

    listen.port=<P> listen.workers=1 listen.reuse_port=true [shared_load.enabled=true]

Each worker binds the port with ``SO_REUSEPORT``, so the kernel spreads new client
connections over the workers (no accept lock, no fd passing). When ``listen.port`` is 0
the supervisor picks a free port and keeps a bound, non-listening ``SO_REUSEPORT`` socket
on it so that a restarted worker gets the same port back.

Workers share the prefix index through Redis (``index.backend: redis``); when a Redis URL
is configured (``shared_load.url`` or ``index.url``) the supervisor also turns on
``shared_load`` for them (:mod:`router.reservations`), so N workers balance on fleet-wide
in-flight counts instead of N private ones. Without Redis each worker keeps its own
memory index and counts (logged as a warning).

Supervision:
  * a worker that exits while the supervisor is not stopping is restarted, with a backoff
    (:class:`RestartPolicy`, pure) that grows while workers keep crashing within
    ``MIN_UPTIME_S`` of their start and resets after a healthy run;
  * SIGTERM / SIGINT → SIGTERM to every worker (each drains as ``kvrouter serve`` does,
    see router/lifecycle.py), wait, exit 0; a second signal is forwarded too (drain cut
    short);
  * SIGHUP → forwarded to every worker (each re-reads the same config sources);
  * a worker failing with exit code 2 (config error) on its first start stops everything
    with exit code 2.

Workers run in their own session (a terminal's Ctrl-C reaches only the supervisor, which
forwards one SIGTERM) and get SIGTERM if the supervisor dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from router.config import Config

log = logging.getLogger("kvrouter.workers")

MIN_UPTIME_S = 5.0
POLL_S = 0.1


@dataclass(slots=True)
class RestartPolicy:
    """When to restart a crashed worker. Pure: times are passed in."""

    base_s: float = 0.2
    max_s: float = 30.0
    min_uptime_s: float = MIN_UPTIME_S
    failures: int = 0

    def delay(self, started_at: float, ended_at: float) -> float:
        """Seconds to wait before restarting a worker that ran from ``started_at`` to ``ended_at``."""
        if ended_at - started_at >= self.min_uptime_s:
            self.failures = 0
        self.failures += 1
        return min(self.max_s, self.base_s * (2 ** (self.failures - 1)))


@dataclass(slots=True)
class Worker:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restart_at: float | None = None
    restarts: int = 0
    pids: list[int] = field(default_factory=list)


def _child_setup() -> None:  # runs in the child between fork and exec
    # a SIGHUP that arrives before the worker installed its reload handler must not kill it
    # (the ignored disposition survives exec; router/lifecycle.py replaces it)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound (not listening) SO_REUSEPORT socket holding ``host:port`` (0 picks one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((host, port))
    return s


def worker_overrides(cfg: Config, port: int) -> list[str]:
    """The ``--set`` overrides every worker gets on top of the supervisor's own arguments."""
    out = [f"listen.port={port}", "listen.workers=1", "listen.reuse_port=true"]
    if cfg.shared_load.url or cfg.index.url:
        out.append("shared_load.enabled=true")
    return out


class Supervisor:
    """Start, watch, restart and stop the workers (see module docstring)."""

    def __init__(self, cfg: Config, serve_args: list[str], *, python: str = sys.executable) -> None:
        self.cfg = cfg
        self.n = cfg.listen.workers
        self.serve_args = serve_args
        self.python = python
        self.policy = RestartPolicy()
        self.workers = [Worker(i) for i in range(self.n)]
        self.stopping = 0
        self.hup = False
        self.holder: socket.socket | None = None
        self.port = cfg.listen.port
        self.termed: set[int] = set()  # pids that got SIGTERM

    def argv(self) -> list[str]:
        extra: list[str] = []
        for o in worker_overrides(self.cfg, self.port):
            extra += ["--set", o]
        return [self.python, "-m", "router.cli", "serve", *self.serve_args, *extra]

    def spawn(self, w: Worker) -> None:
        env = {**os.environ, "KVROUTER_WORKER_ID": str(w.index)}
        w.proc = subprocess.Popen(self.argv(), env=env, start_new_session=True, preexec_fn=_child_setup)
        w.started_at = time.monotonic()
        w.restart_at = None
        w.pids.append(w.proc.pid)
        log.info("worker %d started (pid %d)", w.index, w.proc.pid)

    def signal_all(self, sig: int) -> None:
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(sig)
                if sig == signal.SIGTERM:
                    self.termed.add(w.proc.pid)

    def _on_stop(self, signum: int, frame: object) -> None:
        self.stopping += 1
        self.signal_all(signal.SIGTERM)

    def _on_hup(self, signum: int, frame: object) -> None:
        self.hup = True

    def run(self) -> int:
        if not (self.cfg.shared_load.url or self.cfg.index.url):
            log.warning("%d workers without Redis: each keeps its own index and in-flight counts "
                        "(set index.backend: redis and index.url to share them)", self.n)
        self.holder = reserve_port(self.cfg.listen.host, self.port)
        self.port = self.holder.getsockname()[1]
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        for w in self.workers:
            self.spawn(w)
        host = self.cfg.listen.host
        print(f"kvrouter supervisor: {self.n} workers on http://{host}:{self.port} "
              f"(pids {' '.join(str(w.proc.pid) for w in self.workers if w.proc)})", flush=True)
        try:
            return self._watch()
        finally:
            self.signal_all(signal.SIGKILL)
            self.holder.close()

    def _watch(self) -> int:
        grace = self.cfg.lifecycle.shutdown_grace_s + self.cfg.lifecycle.drain_delay_s + 10.0
        stop_deadline: float | None = None
        forwarded = 0
        while True:
            now = time.monotonic()
            if self.hup:
                self.hup = False
                log.info("SIGHUP: forwarding to %d workers", self.n)
                self.signal_all(signal.SIGHUP)
            if self.stopping:
                if forwarded < self.stopping:
                    forwarded = self.stopping
                if stop_deadline is None:
                    stop_deadline = now + grace
                # a worker spawned while the signal handler ran (before ``w.proc`` was set)
                # missed the SIGTERM: send it now rather than wait out the grace period
                for w in self.workers:
                    if w.proc is not None and w.proc.poll() is None and w.proc.pid not in self.termed:
                        self.termed.add(w.proc.pid)
                        with contextlib.suppress(ProcessLookupError):
                            w.proc.send_signal(signal.SIGTERM)
                if all(w.proc is None or w.proc.poll() is not None for w in self.workers):
                    log.info("all workers stopped")
                    return 0
                if now >= stop_deadline:
                    log.warning("workers still running after %.0fs: killing them", grace)
                    return 0
                time.sleep(POLL_S)
                continue
            for w in self.workers:
                if w.proc is not None and w.proc.poll() is not None:
                    code = w.proc.returncode
                    if code == 2 and w.restarts == 0:
                        log.error("worker %d refused its config (exit 2): stopping", w.index)
                        self.stopping = 1
                        self.signal_all(signal.SIGTERM)
                        self._wait_all(5.0)
                        return 2
                    delay = self.policy.delay(w.started_at, now)
                    log.warning("worker %d (pid %d) exited with %s; restarting in %.1fs",
                                w.index, w.proc.pid, code, delay)
                    w.proc = None
                    w.restart_at = now + delay
                if w.proc is None and w.restart_at is not None and now >= w.restart_at:
                    w.restarts += 1
                    self.spawn(w)
            time.sleep(POLL_S)

    def _wait_all(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for w in self.workers:
            if w.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    w.proc.wait(max(0.0, end - time.monotonic()))


def strip_workers_flag(argv: list[str]) -> list[str]:
    """``argv`` of ``kvrouter serve`` without ``--workers N`` / ``--workers=N``."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--workers":
            skip = True
            continue
        if a.startswith("--workers="):
            continue
        out.append(a)
    return out


def supervise(cfg: Config, serve_argv: list[str]) -> int:
    """Run ``cfg.listen.workers`` workers until SIGTERM/SIGINT; the exit code."""
    from router.logs import setup_logging

    setup_logging(cfg.logging)
    return Supervisor(cfg, strip_workers_flag(serve_argv)).run()
