"""Exact vs approximate cache tracking, side by side, offline and live, with engine caches
small enough to evict.

* offline: ``loadtest.offline.simulate`` (the router's ``cache_aware`` policy and pure index
  in front of the simulator's engine model, virtual time) run twice on the same seeded
  workload: ``tracking="approx"`` (the router's own records) and ``tracking="exact"``
  (plus every engine KV event applied to the index);
* live: ``--replicas`` ``kvrouter sim`` processes publishing KV events over ZMQ, the real
  router in process (``cache_aware``), the trace replayed over HTTP with
  ``loadtest.live.replay_live``; once with the replicas' ``kv_events`` unset (approximate)
  and once set (exact), engine caches reset in between.

Hit rate = cached prompt tokens ÷ prompt tokens as the engines report them (usage
``cached_tokens``), so both columns are measured by the engines, not predicted by the
router. Run::

    .venv/bin/python -m loadtest.bench_exact               # offline + live
    .venv/bin/python -m loadtest.bench_exact --offline-only --requests 3000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtest.offline import OfflineConfig, roofline_for, simulate
from loadtest.traces.generators import tenants
from loadtest.traces.types import TraceRequest

MODEL = "llama-3.1-8b"


def workload(n: int, seed: int, block_size: int = 16) -> list[TraceRequest]:
    """Tenants sharing long system prompts (Zipf popularity): many more distinct prefixes
    than the engines can hold, so caches evict."""
    return tenants(n_requests=n, n_tenants=48, zipf_s=0.9, rate=20.0, system_blocks=(16, 48),
                   user_blocks=(2, 8), output=(4, 16), block_size=block_size, seed=seed)


def run_offline(reqs: list[TraceRequest], replicas: int, num_blocks: int, seed: int) -> dict[str, Any]:
    cfg = OfflineConfig(replicas=replicas, model=MODEL, gpu="a100-80gb", seed=seed, scrape_interval_s=0.5)
    out: dict[str, Any] = {}
    for tracking in ("approx", "exact"):
        roof = roofline_for(cfg)
        roof.kv_capacity_blocks = num_blocks  # small caches: evictions matter
        t0 = time.perf_counter()
        res = simulate(reqs, "cache_aware", replace(cfg, tracking=tracking), roof)
        out[tracking] = {"hit_rate": res.hit_rate, "ttft_p50_s": res.ttft_p50_s, "ttft_p99_s": res.ttft_p99_s,
                         "load_imbalance": res.load_imbalance, "wall_s": time.perf_counter() - t0}
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except Exception:
        return False


def _post(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=10).close()


async def run_live(reqs: list[TraceRequest], replicas: int, num_blocks: int, time_scale: float,
                   concurrency: int, speed: float, repeat: int = 1) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="kvr-bench-exact-"))
    procs: list[subprocess.Popen[bytes]] = []
    reps: list[dict[str, Any]] = []
    try:
        for i in range(replicas):
            port = _free_port()
            ev = {"endpoint": f"ipc://{tmp}/pub{i}", "replay_endpoint": f"ipc://{tmp}/replay{i}", "topic": ""}
            kv = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", **ev})
            argv = [sys.executable, "-m", "router.cli", "sim", "--host", "127.0.0.1", "--port", str(port),
                    "--model", MODEL, "--gpu", "a100-80gb", "--num-blocks", str(num_blocks),
                    "--block-size", "16", "--time-scale", str(time_scale), "--seed", str(i),
                    "--kv-events-config", kv]
            procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            reps.append({"id": f"r{i}", "url": f"http://127.0.0.1:{port}", "models": [MODEL], "kv_events": ev})
        deadline = time.monotonic() + 60
        while not all(_ok(r["url"] + "/health") for r in reps):
            if time.monotonic() > deadline:
                raise RuntimeError("simulated engines did not start")
            time.sleep(0.1)
        runs: dict[str, list[dict[str, Any]]] = {"approx": [], "exact": []}
        for rep in range(repeat):  # alternate the order so drift on a shared machine cancels
            for tracking in (("approx", "exact") if rep % 2 == 0 else ("exact", "approx")):
                runs[tracking].append(await _live_once(reqs, reps, tracking, num_blocks, concurrency, speed))
        return {k: _mean(v) for k, v in runs.items()}
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)


async def _live_once(reqs: list[TraceRequest], reps: list[dict[str, Any]], tracking: str, num_blocks: int,
                     concurrency: int, speed: float) -> dict[str, Any]:
    from loadtest.live import LiveOptions, replay_live
    from router.config import Config
    from router.server import Server

    for r in reps:
        _post(r["url"] + "/reset_prefix_cache")
    cfg = Config.from_dict({
        "listen": {"host": "127.0.0.1", "port": 0},
        "policy": {"name": "cache_aware"},
        "models": {MODEL: {"tokenizer": "builtin", "block_size": 16}},
        "index": {"backend": "memory", "capacity_blocks": num_blocks},
        "replicas": [r if tracking == "exact" else {k: v for k, v in r.items() if k != "kv_events"}
                     for r in reps],
        "health": {"interval_s": 1.0}, "logging": {"requests": False}})
    server = await Server(cfg, seed=0).start()
    try:
        await asyncio.sleep(0.5)  # subscribers connect
        sub = getattr(server.state.prefix, "events", None)
        if sub is not None:  # start measuring once the engines' replay buffers are applied
            await sub.idle(timeout=120)
        t0 = time.perf_counter()
        try:
            res = await asyncio.wait_for(replay_live(reqs, LiveOptions(
                target=server.url, model=MODEL, speed=speed, max_concurrency=concurrency, timeout_s=120)), 900)
        except TimeoutError:  # report what is stuck instead of hanging the benchmark
            _dump_tasks()
            raise
        s = res.summary
        out = {"hit_rate": s["hit_rate"], "ok": s["ok"], "requests": s["requests"],
               "ttft_p50_s": s["ttft_p50_s"], "load_imbalance": s["load_imbalance"],
               "wall_s": time.perf_counter() - t0}
        if sub is not None:
            out["events"] = _event_stats(sub)
        return out
    finally:
        try:
            await asyncio.wait_for(server.stop(), 60)
        except TimeoutError:  # report what is stuck instead of hanging the benchmark
            _dump_tasks()
            raise


def _dump_tasks() -> None:
    for t in asyncio.all_tasks():
        print(f"--- {t.get_name()} {t.get_coro()!r}", file=sys.stderr)
        t.print_stack(file=sys.stderr)


def _mean(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: sum(r[k] for r in runs) / len(runs) for k in
                           ("hit_rate", "ttft_p50_s", "load_imbalance", "wall_s")}
    out["hit_rates"] = [r["hit_rate"] for r in runs]
    out["ok"] = sum(r["ok"] for r in runs)
    out["requests"] = sum(r["requests"] for r in runs)
    if "events" in runs[-1]:
        out["events"] = runs[-1]["events"]
    return out


def _event_stats(sub: Any) -> dict[str, Any]:
    tot: dict[str, Any] = {}
    for rid in sub.replicas():
        st = sub.stats(rid)
        ts = sub.tracker(rid).stats
        for k, v in (("events", st.events), ("gaps", st.gaps), ("replays", st.replays),
                     ("decode_errors", st.decode_errors), ("clears", st.clears),
                     ("stored_blocks", ts.stored_blocks), ("removed_blocks", ts.removed_blocks),
                     ("unknown_parent", ts.unknown_parent)):
            tot[k] = tot.get(k, 0) + v
    lag = {s.name: s.value for m in sub.metrics.lag.collect() for s in m.samples if not s.labels}
    n = lag.get("kvrouter_kv_event_lag_seconds_count", 0)
    tot["lag_mean_ms"] = 1000 * lag.get("kvrouter_kv_event_lag_seconds_sum", 0) / n if n else None
    return tot


def table(title: str, res: dict[str, Any]) -> str:
    a, e = res["approx"], res["exact"]
    ratio = e["hit_rate"] / a["hit_rate"] if a["hit_rate"] else float("inf")
    lines = [title, f"  {'':<16}{'approximate':>14}{'exact':>14}",
             f"  {'hit rate':<16}{a['hit_rate']:>14.3f}{e['hit_rate']:>14.3f}   exact/approx = {ratio:.3f}",
             f"  {'ttft p50 (s)':<16}{a['ttft_p50_s']:>14.4f}{e['ttft_p50_s']:>14.4f}",
             f"  {'load max/mean':<16}{a['load_imbalance']:>14.3f}{e['load_imbalance']:>14.3f}",
             f"  {'wall (s)':<16}{a['wall_s']:>14.1f}{e['wall_s']:>14.1f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_exact", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="offline requests (default 2000)")
    p.add_argument("--live-requests", type=int, default=400, help="live requests (default 400)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks per engine (default 256: evicts)")
    p.add_argument("--time-scale", type=float, default=0.02, help="live sims' wall s per simulated s")
    p.add_argument("--speed", type=float, default=4.0, help="live replay speed-up of the trace clock")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3, help="live runs per mode, order alternated (default 3)")
    p.add_argument("--offline-only", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    a = p.parse_args(argv)
    report: dict[str, Any] = {"replicas": a.replicas, "num_blocks": a.num_blocks, "policy": "cache_aware"}
    report["offline"] = run_offline(workload(a.requests, a.seed), a.replicas, a.num_blocks, a.seed)
    if not a.offline_only:
        report["live"] = asyncio.run(run_live(workload(a.live_requests, a.seed + 1), a.replicas, a.num_blocks,
                                              a.time_scale, a.concurrency, a.speed, a.repeat))
    if a.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"cache_aware on {a.replicas} engines of {a.num_blocks} blocks x 16 tokens")
    print(table(f"offline ({a.requests} requests, virtual time)", report["offline"]))
    if "live" in report:
        print(table(f"live ({a.live_requests} requests over HTTP x {a.repeat} runs per mode, time scale "
                    f"{a.time_scale}; means)", report["live"]))
        lv = report["live"]
        print(f"  hit rate per run: approximate {[round(x, 3) for x in lv['approx']['hit_rates']]}, "
              f"exact {[round(x, 3) for x in lv['exact']['hit_rates']]}")
        print(f"  exact-mode events (last run): {lv['exact'].get('events')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
