"""Multi-process serving: shared in-flight accounting between processes through a real Redis
(a crashed process's reservations expire, a clean exit removes them at once), and
``kvrouter serve --workers 2`` (one port, a crashed worker restarted, SIGHUP forwarded,
SIGTERM drains every worker and exits 0)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from router.core.types import ReplicaState
from router.reservations import SharedLoad, apply_reserved, own_counts, parse_totals
from router.workers import RestartPolicy, strip_workers_flag, worker_overrides
from tests.support.services import ROOT, Proc, free_port, kvrouter_argv

TTL_S = 2.0  # shared-load ttl of every process here: generous, a loaded machine may starve one

CHILD = """
import asyncio, sys
from router.core.types import ReplicaState
from router.reservations import SharedLoad

async def main():
    url, pid_tag, counts = sys.argv[1], sys.argv[2], sys.argv[3]
    states = [ReplicaState(id=k, in_flight=int(v)) for k, v in (c.split('=') for c in counts.split(','))]
    sl = SharedLoad(url, lambda: states, namespace='wt', interval_s=0.05, ttl_s=TTL, proc_id=pid_tag,
                    timeout_s=5.0)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(15, stop.set)
    await sl.start()
    print('ready', flush=True)  # only once SIGTERM means a clean exit
    await stop.wait()
    await sl.close()

asyncio.run(main())
""".replace("TTL", str(TTL_S))


def spawn_child(url: str, tag: str, counts: str, timeout: float = 60.0) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", CHILD, url, tag, counts], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert p.stdout is not None
    # never block without a deadline on a child that may not start
    ready = select.select([p.stdout], [], [], timeout)[0]
    line = p.stdout.readline() if ready else "(nothing in time)"
    if line.strip() != "ready":
        p.kill()
        p.wait(5)
        raise AssertionError(f"child {tag} did not start: {line}")
    return p


async def wait_for(cond, timeout: float = 10.0, every: float = 0.05) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if await cond():
            return
        await asyncio.sleep(every)
    raise AssertionError("condition not reached in time")


def test_pure_helpers() -> None:
    states = [ReplicaState(id="a", in_flight=2), ReplicaState(id="b"), ReplicaState(id="c", in_flight=1)]
    assert own_counts(states) == ["a", 2, "c", 1]
    totals = parse_totals([b"a", 3, b"b", 1])
    assert totals == {"a": 3.0, "b": 1.0}
    apply_reserved(states, totals)
    assert [s.reserved for s in states] == [3.0, 1.0, 0.0]
    assert [s.load for s in states] == [5.0, 1.0, 1.0]  # own in-flight + the others'


def test_restart_policy_backs_off_and_resets() -> None:
    p = RestartPolicy(base_s=0.2, max_s=2.0, min_uptime_s=5.0)
    assert [p.delay(0.0, 1.0) for _ in range(6)] == [0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert p.delay(0.0, 10.0) == 0.2  # a healthy run resets the backoff


def test_worker_args() -> None:
    assert strip_workers_flag(["--workers", "3", "-c", "x.yaml", "--workers=2", "--port", "1"]) == [
        "-c", "x.yaml", "--port", "1"]
    from router.config import Config

    cfg = Config.from_dict({"index": {"backend": "redis", "url": "redis://127.0.0.1:1"}})
    assert "shared_load.enabled=true" in worker_overrides(cfg, 8000)
    assert "shared_load.enabled=true" not in worker_overrides(Config(), 8000)


async def test_processes_share_reservations_and_a_crash_expires(redis_url) -> None:
    a = spawn_child(redis_url, "proc-a", "r0=3,r1=1")
    b = spawn_child(redis_url, "proc-b", "r1=2")
    mine = [ReplicaState(id="r0", in_flight=1), ReplicaState(id="r1"), ReplicaState(id="r2")]
    me = SharedLoad(redis_url, lambda: mine, namespace="wt", interval_s=0.05, ttl_s=TTL_S, proc_id="me",
                    timeout_s=5.0)
    try:
        await me.start()
        await wait_for(lambda: _reserved(me, mine, {"r0": 3.0, "r1": 3.0, "r2": 0.0}))
        assert mine[0].load == 4.0  # 1 own + 3 from proc-a
        a.send_signal(signal.SIGKILL)  # a crash: nobody deletes proc-a's counts
        a.wait(10)
        t0 = time.monotonic()
        await wait_for(lambda: _reserved(me, mine, {"r0": 0.0, "r1": 2.0, "r2": 0.0}))
        waited = time.monotonic() - t0
        assert waited > TTL_S / 4, "expired too early: ttl must hold a live process's counts"
        b.send_signal(signal.SIGTERM)  # a clean exit removes its counts at once (not after the ttl)
        assert b.wait(20) == 0
        await wait_for(lambda: _reserved(me, mine, {"r0": 0.0, "r1": 0.0, "r2": 0.0}), timeout=TTL_S / 2)
    finally:
        await me.close()
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait(5)


async def _reserved(me: SharedLoad, states: list[ReplicaState], want: dict[str, float]) -> bool:
    await me.sync()
    return {s.id: s.reserved for s in states} == want


async def test_shared_load_survives_redis_down(redis_server) -> None:
    from tests.support.services import RedisServer

    srv = RedisServer().start()
    states = [ReplicaState(id="r0", in_flight=1)]
    me = SharedLoad(srv.url, lambda: states, namespace="wt2", interval_s=0.05, ttl_s=0.3,
                    timeout_s=5.0)  # a loaded machine must not time out the first sync
    try:
        await me.start()
        assert me.up and me.syncs >= 1
        srv.stop(kill=True)
        states[0].reserved = 5.0
        await wait_for(lambda: _async(not me.up and states[0].reserved == 0.0), timeout=5)
        srv.start()
        await wait_for(lambda: _async(me.up), timeout=10)
    finally:
        await me.close()
        srv.stop()


async def _async(v: bool) -> bool:
    return v


def _post(url: str) -> int:
    req = urllib.request.Request(url + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "llama-3.1-8b", "prompt": "hello", "max_tokens": 2}).encode())
    with urllib.request.urlopen(req, timeout=20) as r:
        return r.status


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by the supervisor) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _pids(log: str) -> list[int]:
    return [int(p) for p in re.findall(r"worker \d started \(pid (\d+)\)", log)]


@pytest.mark.timeout(120)
def test_serve_workers_restart_reload_and_drain(redis_server, sim_factory) -> None:
    (sim,) = sim_factory(1, time_scale=0)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc(kvrouter_argv("serve", "--workers", "2", "--port", str(port), "--policy", "least_loaded",
                              "--no-request-log", "--replica", f"{sim.url}=llama-3.1-8b",
                              "--set", "index.backend=redis", "--set", f"index.url={redis_server.url}",
                              "--set", "shared_load.namespace=wtest"),
                ready_url=url + "/health").start()

    def log() -> str:  # the whole log: Proc.log() keeps only its tail, and the counts below need all of it
        return proc.log_path.read_text(errors="replace")

    try:
        assert all(_post(url) == 200 for _ in range(6))
        deadline = time.monotonic() + 20
        while len(_pids(log())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        first = _pids(log())
        assert len(first) == 2 and all(_alive(p) for p in first)
        # both workers registered in the shared load accounting
        import redis as redis_sync

        r = redis_sync.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + 20
        while r.zcard("wtest:{load}:procs") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.zcard("wtest:{load}:procs") == 2

        os.kill(first[0], signal.SIGKILL)  # a worker crashes: restarted on the same port
        deadline = time.monotonic() + 30
        while len(_pids(log())) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = _pids(log())
        assert len(pids) == 3 and _alive(pids[2]) and not _alive(first[0]), log()
        assert "exited with -9; restarting" in log()
        deadline = time.monotonic() + 20
        ok = 0
        while ok < 6 and time.monotonic() < deadline:
            try:
                ok += _post(url) == 200
            except OSError:
                time.sleep(0.1)
        assert ok == 6
        # the crashed worker's entry expires (shared_load.ttl_s); the two live ones remain
        def members() -> set[int]:
            return {int(m.decode().split(":")[-2]) for m in r.zrange("wtest:{load}:procs", 0, -1)}

        deadline = time.monotonic() + 15
        while members() != {first[1], pids[2]} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert members() == {first[1], pids[2]}
        deadline = time.monotonic() + 30  # the restarted worker is listening
        while log().count("kvrouter listening on") < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.signal(signal.SIGHUP)  # forwarded: every worker reloads
        deadline = time.monotonic() + 20
        while log().count("config reload") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "SIGHUP: forwarding to 2 workers" in log()
        assert log().count("config reload") >= 2, log()
        live = [p for p in pids if _alive(p)]
        assert proc.stop(timeout=30) == 0
        assert not any(_alive(p) for p in live)
        assert members() == set()  # clean exits leave nothing behind
        r.close()
    finally:
        proc.stop()
