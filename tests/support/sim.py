"""Start and stop ``kvrouter sim`` processes on free loopback ports, for integration tests.

    sims = start_sims(3, time_scale=0, num_blocks=512)   # all started in parallel
    sims[0].url        # "http://127.0.0.1:PORT"
    sims[0].kill(); sims[0].restart()                     # same port again
    stop_sims(sims)

Keyword flags map to CLI options: ``num_blocks=512`` → ``--num-blocks 512``,
``no_prefix_caching=True`` → ``--no-prefix-caching`` (False/None omit the flag). The
``sim_factory`` fixture starts sims and stops every one of them when the test ends::

    def test_x(sim_factory):
        a, b = sim_factory(2, time_scale=0)
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.services import Proc, free_port, http_ok, kvrouter_argv

DEFAULT_FLAGS: dict[str, Any] = {"time_scale": 0}


def sim_argv(port: int, **flags: Any) -> list[str]:
    """The argv of ``kvrouter sim`` on ``port`` with ``flags`` (see module docstring)."""
    args = ["sim", "--host", "127.0.0.1", "--port", str(port)]
    for key, value in flags.items():
        opt = "--" + key.replace("_", "-")
        if value is True:
            args.append(opt)
        elif value is False or value is None:
            continue
        else:
            args += [opt, str(value)]
    return kvrouter_argv(*args)


class SimHandle:
    """One ``kvrouter sim`` child process on a fixed port."""

    def __init__(self, port: int | None = None, **flags: Any) -> None:
        self.port = port or free_port()
        self.flags = {**DEFAULT_FLAGS, **flags}
        self.proc = Proc(sim_argv(self.port, **self.flags))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.proc.pid if self.proc.proc else None

    def launch(self) -> SimHandle:
        """Start the process without waiting for it to be ready."""
        self.proc.start()
        return self

    def wait_ready(self, timeout: float = 30.0) -> SimHandle:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            p = self.proc.proc
            if p is not None and p.poll() is not None:
                raise RuntimeError(f"kvrouter sim on port {self.port} exited:\n{self.proc.log()}")
            if http_ok(self.url + "/health"):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"kvrouter sim on port {self.port} not ready:\n{self.proc.log()}")

    def start(self, timeout: float = 30.0) -> SimHandle:
        return self.launch().wait_ready(timeout)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit within 10 s."""
        self.proc.stop()

    def kill(self) -> None:
        """SIGKILL (a crash); ``restart()`` brings it back on the same port."""
        if self.proc.proc and self.proc.proc.poll() is None:
            self.proc.signal(signal.SIGKILL)
            self.proc.proc.wait(5)

    def restart(self, timeout: float = 30.0) -> SimHandle:
        self.stop()
        self.proc = Proc(sim_argv(self.port, **self.flags), log=self.proc.log_path)
        return self.start(timeout)

    def alive(self) -> bool:
        return self.proc.proc is not None and self.proc.proc.poll() is None

    def log(self) -> str:
        return self.proc.log()


def start_sims(n: int, timeout: float = 30.0, **flags: Any) -> list[SimHandle]:
    """Start ``n`` sims in parallel (each on its own free port) and wait until all answer."""
    sims = [SimHandle(**flags) for _ in range(n)]
    try:
        for s in sims:
            s.launch()
        for s in sims:
            s.wait_ready(timeout)
    except BaseException:
        stop_sims(sims)
        raise
    return sims


def stop_sims(sims: list[SimHandle]) -> None:
    for s in sims:
        s.stop()


def _factory() -> Iterator[Any]:
    started: list[SimHandle] = []

    def factory(n: int = 1, **flags: Any) -> list[SimHandle]:
        sims = start_sims(n, **flags)
        started.extend(sims)
        return sims

    try:
        yield factory
    finally:
        stop_sims(started)


@pytest.fixture
def sim_factory() -> Iterator[Any]:
    """``sim_factory(n, **flags) -> list[SimHandle]``; every sim started is stopped at teardown."""
    yield from _factory()


@pytest.fixture(scope="module")
def sim_factory_module() -> Iterator[Any]:
    """Like ``sim_factory``, but the sims live for the whole test module (cheaper)."""
    yield from _factory()
