"""Exact vs approximate cache tracking, side by side, offline and live, with engine caches
small enough to evict.

* offline: ``loadtest.offline.simulate`` (the router's ``cache_aware`` policy and pure index
  in front of the simulator's engine model, virtual time) run twice on the same seeded
  workload: ``tracking="approx"`` (the router's own records) and ``tracking="exact"``
  (plus every engine KV event applied to the index);
* live: ``--replicas`` ``kvrouter sim`` processes publishing KV events over ZMQ, the real
  router in process (``cache_aware``), the trace replayed over HTTP with
  ``loadtest.live.replay_live``; approximate (the replicas' ``kv_events`` unset) and exact
  runs interleaved in A/B pairs, order alternated, engine caches reset before every run.
  One scenario per ``--direct`` share: that share of the trace goes straight to the
  engines (other clients' traffic the router never sees — what exact tracking is for);
  ``--routers N`` runs N routers with their own memory indexes, the trace dealt between
  them.

Hit rate = cached prompt tokens ÷ prompt tokens as the engines report them (usage
``cached_tokens``), so both columns are measured by the engines, not predicted by the
router; the router's own prediction (matched tokens of its decisions) is printed against
it. Run::

    .venv/bin/python -m loadtest.bench_exact               # offline + live, ~3-4 min
    .venv/bin/python -m loadtest.bench_exact --offline-only --requests 3000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtest.offline import OfflineConfig, roofline_for, simulate
from loadtest.procs import free_port as _free_port
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


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except Exception:
        return False


def _post(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=10).close()


async def run_live(reqs: list[TraceRequest], replicas: int, num_blocks: int, time_scale: float,
                   concurrency: int, speed: float, repeat: int = 3,
                   scenarios: tuple[tuple[int, float], ...] = ((1, 0.0),)) -> dict[str, dict[str, Any]]:
    """Per scenario (router count, share of the trace sent straight to the engines):
    ``repeat`` pairs of live runs (approximate then exact, the next pair exact then
    approximate: A B B A A B ...), same sims, caches reset before every run."""
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
        out: dict[str, dict[str, Any]] = {}
        for n, direct in scenarios:
            runs: dict[str, list[dict[str, Any]]] = {"approx": [], "exact": []}
            for rep in range(repeat):  # alternate the order so drift on a shared machine cancels
                for tracking in (("approx", "exact") if rep % 2 == 0 else ("exact", "approx")):
                    runs[tracking].append(await _live_once(reqs, reps, tracking, num_blocks, concurrency,
                                                           speed, n, direct))
            res = {k: _mean(v) for k, v in runs.items()}
            res["ratios"] = [e["hit_rate"] / a["hit_rate"] for a, e in zip(runs["approx"], runs["exact"], strict=True)]
            out[f"{n}:{direct:g}"] = res
        return out
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
                     concurrency: int, speed: float, routers: int = 1, direct: float = 0.0) -> dict[str, Any]:
    """One live run: ``routers`` routers (each its own memory index, as several router
    replicas without a shared Redis), the trace dealt round-robin between them (a load
    balancer in front); a ``direct`` share of the trace (evenly spread) goes straight to the
    engines, round-robin, as traffic of other clients the router never sees. Hit rate from
    the engines' ``cached_tokens``: of the routed requests (``hit_rate``) and of all."""
    from loadtest.live import LiveOptions, replay_live
    from loadtest.summary import summarize_records
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
    servers: list[Any] = []
    predicted = [0]
    try:
        for i in range(routers):  # started inside the try: one that fails stops the others
            servers.append(await Server(cfg, seed=i).start())
        for server in servers:  # the router's own prediction of each request's cached tokens
            policy = server.state.proxy.policy
            choose = policy.choose

            def tally(*a: Any, _choose: Any = choose) -> Any:
                d = _choose(*a)
                predicted[0] += d.matched_tokens or 0
                return d
            policy.choose = tally
        subs = [s for s in (getattr(sv.state.prefix, "events", None) for sv in servers) if s is not None]
        for sub in subs:  # start measuring once the engines' replay buffers are applied
            await sub.idle(timeout=120)
        before = [_event_counts(sub) for sub in subs]
        predicted[0] = 0
        t0 = time.perf_counter()
        try:
            routed = [q for i, q in enumerate(reqs) if int((i + 1) * direct) == int(i * direct)]
            other = [q for i, q in enumerate(reqs) if int((i + 1) * direct) != int(i * direct)]
            targets = [(sv.url, routed[i::routers], max(1, concurrency // routers), True)
                       for i, sv in enumerate(servers)]
            targets += [(r["url"], other[i::len(reps)], 4, False) for i, r in enumerate(reps)] if other else []
            targets = [t for t in targets if t[1]]  # results stay aligned with their targets
            results = await asyncio.wait_for(asyncio.gather(*(replay_live(part, LiveOptions(
                target=url, model=MODEL, speed=speed, max_concurrency=conc, timeout_s=120))
                for url, part, conc, _ in targets)), 900)
        except TimeoutError:  # report what is stuck instead of hanging the benchmark
            _dump_tasks()
            raise
        wall = time.perf_counter() - t0
        s = summarize_records([rec for res, t in zip(results, targets, strict=True) if t[3]
                               for rec in res.records], wall)
        every = summarize_records([rec for res in results for rec in res.records], wall)
        out = {"hit_rate": s["hit_rate"], "hit_rate_all": every["hit_rate"], "ok": s["ok"], "requests": s["requests"],
               "ttft_p50_s": s["ttft_p50_s"], "load_imbalance": s["load_imbalance"], "wall_s": wall,
               "predicted_over_cached": predicted[0] / s["cached_tokens"] if s["cached_tokens"] else None}
        if subs:
            out["events"] = _event_stats(subs)
            window: dict[str, float] = {}
            for sub, b in zip(subs, before, strict=True):
                for k, v in _event_counts(sub).items():
                    window[k] = window.get(k, 0.0) + v - b.get(k, 0.0)
            out["window"] = {k: v for k, v in window.items() if v}
        return out
    finally:
        stuck = False
        for server in servers:  # every router is stopped, even after one that would not stop
            try:
                await asyncio.wait_for(server.stop(), 60)
            except TimeoutError:  # report what is stuck instead of hanging the benchmark
                _dump_tasks()
                stuck = True
        if stuck:
            raise TimeoutError("a router did not stop within 60 s")


def _event_counts(sub: Any) -> dict[str, float]:
    """Clears, gaps and replays so far, by reason/result (all replicas)."""
    want = {"kvrouter_kv_event_clears_total": "clears", "kvrouter_kv_event_gaps_total": "gaps",
            "kvrouter_kv_event_replays_total": "replays"}
    out: dict[str, float] = {}
    for m in sub.metrics.registry.collect():
        for smp in m.samples:
            name = want.get(smp.name)
            if name is not None:
                why = smp.labels.get("reason") or smp.labels.get("result")
                key = f"{name}:{why}" if why else name
                out[key] = out.get(key, 0.0) + smp.value
    return out


def _dump_tasks() -> None:
    for t in asyncio.all_tasks():
        print(f"--- {t.get_name()} {t.get_coro()!r}", file=sys.stderr)
        t.print_stack(file=sys.stderr)


def _mean(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: sum(r[k] for r in runs) / len(runs) for k in
                           ("hit_rate", "hit_rate_all", "ttft_p50_s", "load_imbalance", "wall_s")}
    pred = [r["predicted_over_cached"] for r in runs if r.get("predicted_over_cached") is not None]
    out["predicted_over_cached"] = sum(pred) / len(pred) if pred else None
    out["hit_rates"] = [r["hit_rate"] for r in runs]
    out["ok"] = sum(r["ok"] for r in runs)
    out["requests"] = sum(r["requests"] for r in runs)
    if "events" in runs[-1]:
        out["events"] = runs[-1]["events"]
        window: dict[str, float] = {}
        for r in runs:
            for k, v in r.get("window", {}).items():
                window[k] = window.get(k, 0.0) + v
        out["window"] = window
    return out


def _event_stats(subs: list[Any]) -> dict[str, Any]:
    tot: dict[str, Any] = {}
    n = lag_sum = 0.0
    for sub in subs:
        for rid in sub.replicas():
            st = sub.stats(rid)
            ts = sub.tracker(rid).stats
            for k, v in (("events", st.events), ("decode_errors", st.decode_errors),
                         ("stored_blocks", ts.stored_blocks), ("removed_blocks", ts.removed_blocks),
                         ("unknown_parent", ts.unknown_parent)):
                tot[k] = tot.get(k, 0) + v
        lag = {s.name: s.value for m in sub.metrics.lag.collect() for s in m.samples if not s.labels}
        n += lag.get("kvrouter_kv_event_lag_seconds_count", 0)
        lag_sum += lag.get("kvrouter_kv_event_lag_seconds_sum", 0)
    tot["lag_mean_ms"] = round(1000 * lag_sum / n, 2) if n else None
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


def live_lines(res: dict[str, Any]) -> list[str]:
    """Per-run hit rates, per-pair ratios with their mean and spread, event health."""
    a, e, ratios = res["approx"], res["exact"], res["ratios"]
    mean = statistics.fmean(ratios)
    sd = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    po = [x["predicted_over_cached"] for x in (a, e)]
    return [
        f"  hit rate per run (A/B pairs, order alternated): approximate {[round(x, 3) for x in a['hit_rates']]}",
        f"  {'':<48}exact {[round(x, 3) for x in e['hit_rates']]}",
        f"  exact/approx per pair {[round(x, 3) for x in ratios]}: mean {mean:.3f} ± {sd:.3f} (sd), "
        f"min {min(ratios):.3f}, max {max(ratios):.3f}",
        "  router-predicted / engine-cached tokens: approximate "
        + " ".join("-" if x is None else f"{x:.3f}" for x in po[:1]) + ", exact "
        + " ".join("-" if x is None else f"{x:.3f}" for x in po[1:]),
        f"  hit rate of all requests (routed and direct): approximate {a['hit_rate_all']:.3f}, "
        f"exact {e['hit_rate_all']:.3f}",
        f"  exact mode, during the measured runs (all {len(ratios)}): {e.get('window') or 'no clear, gap or replay'}",
        f"  exact mode, last run (events include the start-up replay of the engines' buffers): {e.get('events')}",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_exact", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000, help="offline requests (default 3000)")
    p.add_argument("--live-requests", type=int, default=600, help="live requests per run (default 600)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks per engine (default 256: evicts)")
    p.add_argument("--time-scale", type=float, default=0.02, help="live sims' wall s per simulated s")
    p.add_argument("--speed", type=float, default=4.0, help="live replay speed-up of the trace clock")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight, all routers together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=5,
                   help="live A/B pairs per scenario, order alternated (default 5)")
    p.add_argument("--routers", default="1",
                   help="router counts to run live, comma-separated (default 1; several routers each have "
                        "their own memory index, the trace is dealt round-robin between them)")
    p.add_argument("--direct", default="0,0.3",
                   help="shares of the trace sent straight to the engines (round-robin), comma-separated, "
                        "one live scenario each (default 0,0.3: none, then 30%% other traffic)")
    p.add_argument("--offline-only", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    a = p.parse_args(argv)
    try:
        routers = tuple(int(x) for x in a.routers.split(","))
        directs = tuple(float(x) for x in a.direct.split(","))
    except ValueError:
        p.error("--routers, --direct: comma-separated numbers")
    if not routers or min(routers) < 1 or a.repeat < 1:
        p.error("--routers and --repeat must be positive")
    if not all(0.0 <= d < 1.0 for d in directs):
        p.error("--direct: shares in [0, 1)")
    report: dict[str, Any] = {"replicas": a.replicas, "num_blocks": a.num_blocks, "policy": "cache_aware"}
    report["offline"] = run_offline(workload(a.requests, a.seed), a.replicas, a.num_blocks, a.seed)
    if not a.offline_only:
        report["live"] = asyncio.run(run_live(workload(a.live_requests, a.seed + 1), a.replicas, a.num_blocks,
                                              a.time_scale, a.concurrency, a.speed, a.repeat,
                                              tuple((n, d) for n in routers for d in directs)))
    if a.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"cache_aware on {a.replicas} engines of {a.num_blocks} blocks x 16 tokens")
    print(table(f"offline ({a.requests} requests, virtual time)", report["offline"]))
    for key, res in report.get("live", {}).items():
        n, d = key.split(":")
        who = "1 router" if n == "1" else f"{n} routers (own memory indexes, requests dealt round-robin)"
        if float(d):
            who += f", {float(d):.0%} of the trace straight to the engines (hit rate: routed requests)"
        print(table(f"live, {who}: {a.live_requests} requests over HTTP x {a.repeat} runs per mode, "
                    f"time scale {a.time_scale}; means", res))
        print("\n".join(live_lines(res)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
