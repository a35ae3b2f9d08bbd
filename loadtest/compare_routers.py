"""Side-by-side live replay of one trace through several routers in front of the SAME
simulated fleet, printed as one table.

    python -m loadtest.compare_routers TRACE --limit 1000 --replicas 8 --gpu h100-80gb \\
        --time-scale 0.2 --speed 5 --policies round_robin,cache_aware --with-offline

Starts ``--replicas`` ``kvrouter sim`` engines once, then for each router in turn: resets
every engine's prefix cache, starts the router (``kvrouter serve`` with each policy of
``--policies``; ``sglang-router`` and ``vllm-router`` with ``--external-policy`` when they
are installed — ``python -m sglang_router.launch_router`` / ``vllm-router`` on PATH — or
skipped with a note), replays the trace through it (:mod:`loadtest.live`), and reads the
engines' ``/metrics`` before and after. Columns: hit rate from usage and from the engines'
prefix-cache counters (these count re-admissions after a
preemption again, usage does not), TTFT p50/p99 (wall seconds), requests per replica as max/mean (from
the engines' request counters, so external routers are measured the same way), errors.
``--with-offline`` adds the offline prediction (:mod:`loadtest.offline`) for kvrouter's
policies, in the same configuration (virtual speed = ``speed × time_scale``; at time scale 0,
where the sims take no time at all, it is ``speed``).

Everything listens on 127.0.0.1 free ports; every process started is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from loadtest.live import LiveOptions, replay_live, scrape
from loadtest.procs import free_port as _free_port
from loadtest.summary import load_imbalance
from loadtest.traces.formats import load_trace


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return 200 <= r.status < 300
    except Exception:
        return False


class _Proc:
    def __init__(self, argv: list[str], ready: list[str], name: str) -> None:
        self.name = name
        self.log = Path(tempfile.mkstemp(prefix=f"kvrouter-compare-{name}-", suffix=".log")[1])
        with self.log.open("ab") as f:
            self.p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{name} exited: {self.log.read_text()[-2000:]}")
            if any(_ok(u) for u in ready):
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{name} not ready after 60 s (log {self.log})")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)


def _kv(*args: str) -> list[str]:
    return [sys.executable, "-m", "router.cli", *args]


def start_router(kind: str, policy: str, sims: list[str], model: str, index_capacity: int) -> tuple[_Proc, str]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    if kind == "kvrouter":
        argv = _kv("serve", "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--no-request-log",
                   "--set", "scrape.interval_s=0.2", "--set", f"index.capacity_blocks={index_capacity}",
                   *[a for u in sims for a in ("--replica", f"{u}={model}")])
        return _Proc(argv, [url + "/ready"], f"kvrouter-{policy}"), url
    prom = str(_free_port())
    if kind == "sglang-router":
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", prom, "--policy", policy,
                "--worker-urls", *sims]
    else:
        argv = [shutil.which("vllm-router") or "vllm-router", "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-port", prom, "--policy", policy, "--worker-urls", *sims]
    return _Proc(argv, [url + "/health", url + "/v1/models"], f"{kind}-{policy}"), url


def external_available(kind: str) -> bool:
    if kind == "sglang-router":
        return importlib.util.find_spec("sglang_router") is not None
    return shutil.which("vllm-router") is not None


def _reset(urls: list[str]) -> None:
    for u in urls:
        req = urllib.request.Request(u + "/reset_prefix_cache", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=10):
            pass


def _engine_deltas(before: list, after: list) -> dict[str, Any]:
    q = h = pre = 0.0
    counts: dict[str, int] = {}
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        b, a = b or {}, a or {}
        q += a.get("vllm:prefix_cache_queries_total", 0.0) - b.get("vllm:prefix_cache_queries_total", 0.0)
        h += a.get("vllm:prefix_cache_hits_total", 0.0) - b.get("vllm:prefix_cache_hits_total", 0.0)
        pre += a.get("vllm:num_preemptions_total", 0.0) - b.get("vllm:num_preemptions_total", 0.0)
        counts[f"e{i}"] = int(a.get("vllm:request_success_total", 0.0) - b.get("vllm:request_success_total", 0.0))
    return {"engine_hit_rate": h / q if q else None, "engine_requests": counts,
            "engine_load_imbalance": load_imbalance(counts), "preemptions": int(pre)}


async def _measure(reqs: list, url: str, sims: list[str], args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        before = await scrape(s, sims)
    res = await replay_live(reqs, LiveOptions(target=url, model=args.model, speed=args.speed,
                                              max_concurrency=args.max_concurrency))
    async with aiohttp.ClientSession() as s:
        after = await scrape(s, sims)
    out = dict(res.summary)
    out.update(_engine_deltas(before, after))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.compare_routers", description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--limit", type=int, default=1000)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--gpu", default="h100-80gb")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--time-scale", type=float, default=0.2, help="sim --time-scale")
    p.add_argument("--speed", type=float, default=5.0, help="replay --speed")
    p.add_argument("--max-concurrency", type=int, default=256)
    p.add_argument("--policies", default="round_robin,cache_aware", help="kvrouter policies")
    p.add_argument("--external", default="sglang-router,vllm-router",
                   help="other routers to run when installed (comma-separated; '' for none)")
    p.add_argument("--external-policy", default="cache_aware")
    p.add_argument("--with-offline", action="store_true", help="add kvrouter's offline prediction")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    reqs = load_trace(args.trace, limit=args.limit)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    from backends.planner import PlanInput, Roofline, get_gpu, get_model

    cap = Roofline(PlanInput(model=get_model(args.model), gpu=get_gpu(args.gpu))).kv_capacity_blocks
    sims: list[_Proc] = []
    try:
        urls = []
        for i in range(args.replicas):
            port = _free_port()
            u = f"http://127.0.0.1:{port}"
            sims.append(_Proc(_kv("sim", "--host", "127.0.0.1", "--port", str(port), "--model", args.model,
                                  "--gpu", args.gpu, "--time-scale", str(args.time_scale), "--seed", str(i)),
                              [u + "/health"], f"sim{i}"))
            urls.append(u)
        runs = [("kvrouter", p.strip()) for p in args.policies.split(",") if p.strip()]
        for kind in [k.strip() for k in args.external.split(",") if k.strip()]:
            if external_available(kind):
                runs.append((kind, args.external_policy))
            else:
                notes.append(f"{kind} is not installed: skipped (pip install {kind})")
        for kind, policy in runs:
            _reset(urls)
            router, url = start_router(kind, policy, urls, args.model, cap)
            try:
                t0 = time.perf_counter()
                s = asyncio.run(_measure(reqs, url, urls, args))
                s["wall_s"] = time.perf_counter() - t0
            finally:
                router.stop()
            rows.append({"router": kind, "policy": policy, **s})
    finally:
        for p in sims:
            p.stop()
    if args.with_offline:
        from loadtest.offline import OfflineConfig, simulate

        cfg = OfflineConfig(replicas=args.replicas, gpu=args.gpu, model=args.model,
                            speed=args.speed * args.time_scale if args.time_scale > 0 else args.speed,
                            index_capacity_blocks=cap)
        for row in rows:
            if row["router"] == "kvrouter":
                row["offline_hit_rate"] = simulate(reqs, row["policy"], cfg).hit_rate
    if args.json:
        print(json.dumps({"rows": rows, "notes": notes}, indent=2, default=str))
        return 0
    print(f"{len(reqs):,} requests, {args.replicas} × {args.gpu} sims ({args.model}), time scale "
          f"{args.time_scale}, replay speed {args.speed}")
    head = f"{'router':<15}{'policy':<14}{'ok':>6}{'hit(usage)':>11}{'hit(engine)':>12}"
    head += f"{'offline':>9}" if args.with_offline else ""
    print(head + f"{'TTFT p50':>10}{'TTFT p99':>10}{'imbalance':>10}{'preempt':>8}{'errors':>8}")
    for r in rows:
        eh = r.get("engine_hit_rate")
        line = f"{r['router']:<15}{r['policy']:<14}{r['ok']:>6}{r['hit_rate']:>11.3f}"
        line += f"{eh:>12.3f}" if eh is not None else f"{'-':>12}"
        if args.with_offline:
            off = r.get("offline_hit_rate")
            line += f"{off:>9.3f}" if off is not None else f"{'-':>9}"
        line += (f"{r['ttft_p50_s']:>10.3f}{r['ttft_p99_s']:>10.3f}{r['engine_load_imbalance']:>10.2f}{r['preemptions']:>8}"
                 f"{sum(r['errors'].values()):>8}")
        print(line)
    for n in notes:
        print("note:", n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
