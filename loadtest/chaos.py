"""``make chaos``: replay a trace through two routers on one Redis in front of four simulated
engines while faults are injected, and account for every request.

Everything runs on 127.0.0.1 and is started (and ended, by PID) by this script: a Redis
(``loadtest.procs.RedisServer`` on a free port), four ``kvrouter sim`` engines and
two ``kvrouter serve`` routers (``cache_aware`` policy, shared Redis index). A client sends
the trace's requests (streaming completions) with bounded concurrency, alternating between
the routers — like a load balancer it sends a request whose connection was *refused* (no
byte sent) to the other router, and counts it as ``rerouted``. Meanwhile, in order:

1. ``kill -9`` an engine, restart it on the same port after ``--hold`` seconds;
2. ``kill -9`` Redis, restart it (empty) after ``--hold`` seconds;
3. ``SIGSTOP`` an engine (it hangs with its sockets open), ``SIGCONT`` after ``--hold`` s;
4. ``SIGTERM`` one router (it drains), start it again once it has exited.

Every request ends in exactly one class: ``completed`` (200 and a stream ending in
``[DONE]`` without an error event), ``failed`` (a clean OpenAI error: an error JSON body
with a 4xx/5xx, or a stream ending with an ``{"error": ...}`` event), ``lost`` (no
response, a connection broken mid-request, a truncated stream without an error event, or
an error that is not OpenAI-shaped) or ``hung`` (no end within ``--timeout``). The table
gives, per fault, the requests sent during it and the hit rate (cached / prompt tokens from
the engines' usage) of requests sent before, during and after it (windows of equal length).
Exit status 1 when anything is lost or hung (or, with ``--soak``, when the router's RSS or
open file descriptors grew), 2 on bad arguments.

The trace: by default the 300-request Mooncake excerpt shipped in ``tests/data``, replayed
in passes (each pass with its own block ids, so every pass has the trace's own reuse) until
``--requests``; ``--trace PATH`` takes any trace ``kvrouter replay`` reads (e.g. the full
Mooncake conversation trace). Prompts are scaled to ``--block-tokens`` tokens per trace
block (Mooncake's are 512) to keep a run to minutes on two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from loadtest.chaos_accounting import (  # noqa: F401  (re-exported: the pure parts)
    Fault,
    Outcome,
    classify_stream,
    flat,
    hit_rate,
    render,
    scaled_requests,
    summarize,
    verdict,
)
from loadtest.hitrate import ideal_infinite
from loadtest.live import LiveOptions, build_body
from loadtest.procs import ROOT, Proc, RedisServer, SimHandle, free_port, kvrouter_argv
from loadtest.traces.formats import load_trace
from loadtest.traces.prompts import PromptBuilder

DEFAULT_TRACE = ROOT / "tests" / "data" / "mooncake_conversation_head300.jsonl"
MODEL = "llama-3.1-8b"
ADMIN_KEY = "chaos-admin-key"


# ---------------------------------------------------------------------- helpers (I/O)


def proc_stats(pid: int) -> tuple[int, int] | None:
    """(RSS bytes, open fds) of a process, from /proc."""
    try:
        rss = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


# ---------------------------------------------------------------------- the run (I/O)


@dataclass
class Fleet:
    redis: RedisServer
    sims: list[SimHandle]
    routers: list[Proc | None]
    router_ports: list[int]
    config_path: Path
    logdir: Path
    in_rotation: list[bool] = field(default_factory=list)
    closed: bool = False

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.router_ports[i]}"


def drain_section() -> dict[str, Any]:
    """``lifecycle`` settings for a graceful drain, when this router version has them."""
    from router.config import Config, ConfigError

    want = {"drain_delay_s": 1.0, "shutdown_grace_s": 30.0}
    try:
        Config.from_dict({"lifecycle": want})
    except ConfigError:
        return {}
    return {"lifecycle": want}


def router_config(redis_url: str, sims: list[SimHandle], args: argparse.Namespace) -> dict[str, Any]:
    return {**drain_section(),
        "listen": {"host": "127.0.0.1", "port": 0},
        "policy": {"name": "cache_aware"},
        "models": {MODEL: {"tokenizer": "builtin", "block_size": 16}},
        "index": {"backend": "redis", "url": redis_url, "namespace": "chaos"},
        "replicas": [{"id": f"sim{i}", "url": s.url, "models": [MODEL]} for i, s in enumerate(sims)],
        "health": {"interval_s": 0.5, "timeout_s": 1.0, "failure_threshold": 2, "success_threshold": 1},
        "scrape": {"interval_s": 0.5, "timeout_s": 1.0},
        "upstream": {"connect_timeout_s": 1.0, "first_byte_timeout_s": args.first_byte_timeout,
                     "idle_timeout_s": args.idle_timeout, "total_timeout_s": args.timeout * 0.75,
                     "max_retries": 3, "retry_backoff_s": 0.05},
        "breaker": {"failure_threshold": 3, "open_s": 2.0, "success_threshold": 2},
        "auth": {"admin_key": ADMIN_KEY},
        "logging": {"level": "warning", "requests": False},
    }


def start_router(fleet: Fleet, i: int) -> Proc:
    port = fleet.router_ports[i]
    p = Proc(kvrouter_argv("serve", "--config", str(fleet.config_path), "--port", str(port)),
             ready_url=f"http://127.0.0.1:{port}/health", log=fleet.logdir / f"router{i}.log")
    p.start(timeout=60)
    fleet.routers[i] = p
    if fleet.closed:  # started from a fault thread after the run ended: do not leak it
        p.stop()
    return p


def start_fleet(args: argparse.Namespace, logdir: Path) -> Fleet:
    redis = RedisServer().start()
    sims = [SimHandle(model=MODEL, time_scale=args.time_scale, seed=i) for i in range(4)]
    for s in sims:
        s.proc.log_path = logdir / f"sim{s.port}.log"
        s.launch()
    for s in sims:
        s.wait_ready(60)
    cfg_path = logdir / "router.yaml"
    cfg_path.write_text(yaml.safe_dump(router_config(redis.url, sims, args)))
    fleet = Fleet(redis, sims, [None, None], [free_port(), free_port()], cfg_path, logdir, [True, True])
    for i in range(2):
        start_router(fleet, i)
    return fleet


def restart_sim(fleet: Fleet, k: int) -> None:
    fleet.sims[k].restart(60)
    if fleet.closed:
        fleet.sims[k].stop()


def restart_redis(fleet: Fleet) -> None:
    fleet.redis.start()
    if fleet.closed:
        fleet.redis.stop()


def stop_fleet(fleet: Fleet) -> None:
    fleet.closed = True
    for p in fleet.routers:
        if p is not None:
            p.stop()
    for s in fleet.sims:
        if s.alive():
            s.proc.signal(signal.SIGCONT)
        s.stop()
    fleet.redis.stop()


async def replica_healthy(session: aiohttp.ClientSession, url: str, rid: str) -> bool:
    try:
        async with session.get(url + "/admin/replicas", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                               timeout=aiohttp.ClientTimeout(total=2)) as r:
            data = await r.json()
        return any(x["id"] == rid and x["healthy"] for x in data["replicas"])
    except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
        return False


async def balancer(fleet: Fleet, interval: float = 0.2) -> None:
    """Keep ``fleet.in_rotation`` as a load balancer would: a router is in while its
    ``/ready`` answers 200."""
    async with aiohttp.ClientSession() as s:
        while True:
            for i in range(2):
                try:
                    async with s.get(fleet.url(i) + "/ready", timeout=aiohttp.ClientTimeout(total=1)) as r:
                        fleet.in_rotation[i] = r.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    fleet.in_rotation[i] = False
            await asyncio.sleep(interval)


async def until(cond: Callable[[], Any], timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = cond()
        if asyncio.iscoroutine(r):
            r = await r
        if r:
            return True
        await asyncio.sleep(step)
    return False


async def send(session: aiohttp.ClientSession, fleet: Fleet, router: int, path: str, body: bytes,
               out: Outcome, timeout: float, t0: float) -> None:
    """One request to router ``router`` (or the other one when refused); fills ``out``."""
    try:
        async with asyncio.timeout(timeout):
            for attempt in range(2):
                r = router if attempt == 0 else 1 - router
                out.router = r
                try:
                    async with session.post(fleet.url(r) + path, data=body,
                                            headers={"Content-Type": "application/json"}) as resp:
                        raw = await resp.read()
                        kind, detail, usage = classify_stream(resp.status, resp.content_type, raw)
                except aiohttp.ClientConnectorError:
                    out.rerouted = True  # refused: nothing was sent; a load balancer tries the other
                    continue
                except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                    kind, detail, usage = "lost", f"connection broken: {type(exc).__name__}", None
                out.kind, out.detail = kind, detail
                if usage:
                    out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    out.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                break
            else:
                out.kind, out.detail = "lost", "both routers refused the connection"
    except TimeoutError:
        out.kind, out.detail = "hung", f"no end within {timeout:g} s"
    out.t_end = time.monotonic() - t0


async def inject_faults(fleet: Fleet, args: argparse.Namespace, progress: Callable[[], int], total: int,
                        faults: list[Fault], t0: float, log: Callable[[str], None]) -> None:
    hold = args.hold
    now = lambda: time.monotonic() - t0  # noqa: E731
    async with aiohttp.ClientSession() as s:
        async def back_in_rotation(rid: str) -> None:
            await until(lambda: all_healthy(rid), 60)

        async def all_healthy(rid: str) -> bool:
            oks = [await replica_healthy(s, fleet.url(i), rid) for i in range(2) if fleet.in_rotation[i]]
            return all(oks)

        steps = [0.15, 0.35, 0.55, 0.75]
        # 1. kill -9 an engine
        await until(lambda: progress() >= steps[0] * total, 3600)
        f = Fault("kill -9 engine sim0, restart", now())
        faults.append(f)
        log(f"[{f.t_start:6.1f}s] kill -9 sim0")
        fleet.sims[0].kill()
        await asyncio.sleep(hold)
        await asyncio.to_thread(restart_sim, fleet, 0)
        await back_in_rotation("sim0")
        f.t_end = now()
        log(f"[{f.t_end:6.1f}s] sim0 back in rotation")
        # 2. kill -9 Redis
        await until(lambda: progress() >= steps[1] * total, 3600)
        f = Fault("kill -9 Redis, restart (empty)", now())
        faults.append(f)
        log(f"[{f.t_start:6.1f}s] kill -9 redis")
        fleet.redis.stop(kill=True)
        await asyncio.sleep(hold)
        await asyncio.to_thread(restart_redis, fleet)
        await asyncio.sleep(2.0)  # the index's breaker retries after 1 s
        f.t_end = now()
        log(f"[{f.t_end:6.1f}s] redis back")
        # 3. SIGSTOP an engine
        await until(lambda: progress() >= steps[2] * total, 3600)
        f = Fault("SIGSTOP engine sim1, SIGCONT", now())
        faults.append(f)
        log(f"[{f.t_start:6.1f}s] SIGSTOP sim1")
        fleet.sims[1].proc.signal(signal.SIGSTOP)
        await asyncio.sleep(hold)
        fleet.sims[1].proc.signal(signal.SIGCONT)
        await back_in_rotation("sim1")
        f.t_end = now()
        log(f"[{f.t_end:6.1f}s] sim1 resumed and back in rotation")
        # 4. SIGTERM a router
        await until(lambda: progress() >= steps[3] * total, 3600)
        f = Fault("SIGTERM router 1, start again", now())
        faults.append(f)
        log(f"[{f.t_start:6.1f}s] SIGTERM router1")
        p = fleet.routers[1]
        assert p is not None and p.proc is not None
        p.signal(signal.SIGTERM)
        rc = await asyncio.to_thread(p.proc.wait, args.timeout)
        log(f"[{now():6.1f}s] router1 exited with {rc}")
        await asyncio.to_thread(start_router, fleet, 1)
        await until(lambda: fleet.in_rotation[1], 30)
        f.t_end = now()
        log(f"[{f.t_end:6.1f}s] router1 serving again")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    trace = load_trace(args.trace, block_size=None)
    reqs = scaled_requests(trace, args.requests, args.block_tokens, args.fresh_passes)
    prompts = PromptBuilder(args.block_tokens, seed=args.seed)
    opts = LiveOptions(target="http://127.0.0.1", model=MODEL, max_output_tokens=args.max_output_tokens)
    logdir = Path(tempfile.mkdtemp(prefix="kvrouter-chaos-"))
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if not args.quiet else (lambda m: None)
    log(f"chaos: logs in {logdir}")
    fleet = start_fleet(args, logdir)
    outs: list[Outcome] = []
    faults: list[Fault] = []
    samples: list[tuple[float, int, int]] = []
    try:
        conn = aiohttp.TCPConnector(limit=args.concurrency * 2 + 8)
        async with aiohttp.ClientSession(connector=conn) as session:
            t0 = time.monotonic()
            done = 0
            sem = asyncio.Semaphore(args.concurrency)
            tasks: set[asyncio.Task[None]] = set()
            fault_task = None if args.no_faults else asyncio.create_task(
                inject_faults(fleet, args, lambda: done, len(reqs), faults, t0, log))

            async def one(o: Outcome, path: str, body: bytes) -> None:
                nonlocal done
                try:
                    await send(session, fleet, o.router, path, body, o, args.timeout, t0)
                finally:
                    done += 1
                    sem.release()

            async def sampler() -> None:
                p = fleet.routers[0]
                while True:
                    st = proc_stats(p.proc.pid) if p is not None and p.proc is not None else None
                    if st:
                        samples.append((time.monotonic() - t0, *st))
                    await asyncio.sleep(args.sample_s)

            samp = asyncio.create_task(sampler())
            lb = asyncio.create_task(balancer(fleet))
            i = 0
            tail_until = math.inf
            while True:
                if i >= len(reqs):
                    faults_done = fault_task is None or fault_task.done()
                    if faults_done and tail_until == math.inf:
                        tail_until = time.monotonic() + args.tail
                    if (faults_done and time.monotonic() >= tail_until) or i >= 4 * len(reqs):
                        break
                req = reqs[i % len(reqs)]
                if args.rate:
                    delay = t0 + i / args.rate - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                await sem.acquire()
                path, body = build_body(req, opts, MODEL, prompts)
                up = [k for k in range(2) if fleet.in_rotation[k]] or [0, 1]
                o = Outcome(i=i, router=up[i % len(up)], t_start=time.monotonic() - t0)
                outs.append(o)
                t = asyncio.create_task(one(o, path, orjson.dumps(body)))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                if i % 500 == 0 and i:
                    s = summarize(outs, [])
                    log(f"[{time.monotonic() - t0:6.1f}s] {i} sent, {s['completed']} completed, "
                        f"{s['failed']} failed, {s['lost']} lost, {s['hung']} hung")
                i += 1
            if tasks:
                await asyncio.gather(*list(tasks))
            if fault_task is not None:
                if not fault_task.done():
                    log("warning: the run ended before every fault was injected")
                    fault_task.cancel()
                try:
                    await fault_task
                except asyncio.CancelledError:
                    pass
            samp.cancel()
            lb.cancel()
            wall = time.monotonic() - t0
    finally:
        stop_fleet(fleet)
    s = summarize(outs, faults)
    s["ideal_hit_rate"] = round(ideal_infinite(reqs).token_rate, 4)
    s["wall_s"] = round(wall, 1)
    s["requests_per_s"] = round(len(outs) / wall, 1) if wall else 0.0
    s["logdir"] = str(logdir)
    if samples:
        ok, msg = flat(samples)
        s["soak"] = {"ok": ok, "detail": msg, "samples": len(samples),
                     "rss_mib_first": round(samples[0][1] / 2**20, 1),
                     "rss_mib_last": round(samples[-1][1] / 2**20, 1),
                     "fds_first": samples[0][2], "fds_last": samples[-1][2]}
    return s


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="trace file (default: the shipped excerpt)")
    p.add_argument("--requests", type=int, default=3000, help="requests to send (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=24, help="most requests in flight (default: %(default)s)")
    p.add_argument("--rate", type=float, default=30.0,
                   help="requests sent per second, 0 = as fast as the window allows (default: %(default)s)")
    p.add_argument("--tail", type=float, default=8.0,
                   help="seconds of traffic after the last fault has recovered (default: %(default)s); the "
                        "run goes past --requests (up to 4x) until then")
    p.add_argument("--block-tokens", type=int, default=64,
                   help="prompt tokens per trace block (Mooncake: 512; default: %(default)s)")
    p.add_argument("--max-output-tokens", type=int, default=24, help="output cap per request (default: %(default)s)")
    p.add_argument("--time-scale", type=float, default=0.05,
                   help="the sims' wall seconds per simulated second (default: %(default)s)")
    p.add_argument("--hold", type=float, default=4.0, help="seconds each fault lasts (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="client timeout: a request not ended by then is 'hung' (default: %(default)s)")
    p.add_argument("--first-byte-timeout", type=float, default=3.0, help="routers' upstream.first_byte_timeout_s")
    p.add_argument("--idle-timeout", type=float, default=3.0, help="routers' upstream.idle_timeout_s")
    p.add_argument("--fresh-passes", action="store_true",
                   help="give each pass over the trace its own block ids (default: passes repeat the "
                        "trace's prompts, so the caches matter and a fault's cost shows in the hit rate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-faults", action="store_true", help="baseline run without faults")
    p.add_argument("--soak", action="store_true",
                   help="longer run (default 20,000 requests) that also fails when router 0's RSS or open "
                        "fds grow (last third of the run vs the middle third)")
    p.add_argument("--sample-s", type=float, default=2.0, help="seconds between RSS/fd samples")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.soak and "--requests" not in (argv if argv is not None else sys.argv[1:]):
        args.requests = 20_000
    if args.requests < 1 or args.concurrency < 1 or args.block_tokens < 1 or args.hold <= 0:
        p.error("--requests, --concurrency, --block-tokens and --hold must be positive")
    if not Path(args.trace).is_file():
        p.error(f"no trace file {args.trace}")
    s = asyncio.run(run(args))
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        print(f"chaos: {s['sent']} requests through 2 routers (1 Redis, 4 simulated engines) in "
              f"{s['wall_s']} s ({s['requests_per_s']} req/s)")
        print(render(s))
        if "soak" in s:
            print(f"router 0: {s['soak']['detail']}")
    bad = verdict(s, args.soak)
    for why in bad:
        print(f"chaos: FAIL: {why}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
