"""Hit-rate demo: cache_aware vs round_robin on four simulated engines, printed side by side.

Four ``kvrouter sim`` engines (processes) whose KV caches hold a few thousand blocks each,
the router in this process, and a seeded synthetic workload: 32 tenants, each with a
distinct 1,000-token system prompt, each running several multi-turn chat sessions (a
user turn, the engine's answer appended, the next turn...). Sessions run concurrently.
For each policy the engines are started fresh (empty caches), the same workload is
replayed through the router, and the engines' own counters are read:
``vllm:prefix_cache_hits_total ÷ vllm:prefix_cache_queries_total`` (tokens), plus the
requests each engine served (max/mean). Target (issue 4): cache_aware's hit rate ≥ 2×
round_robin's with max/mean requests per replica ≤ 1.3.

Run: ``python -m loadtest.hitrate_demo`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import aiohttp

from loadtest.procs import start_sims, stop_sims
from router.config import Config
from router.server import Server

MODEL = "llama-3.1-8b"
WORDS = ["cache", "block", "token", "router", "engine", "prefix", "tenant", "session", "prompt", "system",
         "answer", "question", "replica", "memory", "latency", "batch", "queue", "model", "kv", "gpu"]


def text(rng: random.Random, n_chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(WORDS) + str(rng.randrange(100))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


@dataclass
class Workload:
    systems: list[str]
    sessions: list[tuple[int, list[str]]]  # (tenant, user turns)


def workload(seed: int, tenants: int, sessions_per_tenant: int, turns: int, system_tokens: int,
             turn_tokens: int) -> Workload:
    """Seeded: the built-in tokenizer is one token per byte, so N chars = N tokens."""
    rng = random.Random(seed)
    systems = [f"You are the assistant of tenant {t}. " + text(rng, system_tokens - 40) for t in range(tenants)]
    sessions = [(t, [text(rng, turn_tokens) for _ in range(turns)])
                for t in range(tenants) for _ in range(sessions_per_tenant)]
    rng.shuffle(sessions)
    return Workload(systems, sessions)


def engine_counters(url: str) -> dict[str, float]:
    body = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total"):
        out[name] = sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$",
                                                     body, re.M))
    return out


async def replay(url: str, wl: Workload, concurrency: int, max_tokens: int) -> tuple[int, int]:
    queue: asyncio.Queue[tuple[int, list[str]]] = asyncio.Queue()
    for s in wl.sessions:
        queue.put_nowait(s)
    ok = failed = 0

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal ok, failed
        while not queue.empty():
            tenant, turns = queue.get_nowait()
            msgs: list[dict[str, Any]] = [{"role": "system", "content": wl.systems[tenant]}]
            for turn in turns:
                msgs.append({"role": "user", "content": turn})
                async with http.post(url + "/v1/chat/completions", json={
                        "model": MODEL, "messages": msgs, "max_tokens": max_tokens, "temperature": 0}) as r:
                    data = await r.json()
                if r.status != 200:
                    failed += 1
                    break
                ok += 1
                msgs.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return ok, failed


async def run_policy(policy: str, wl: Workload, args: argparse.Namespace) -> dict[str, Any]:
    sims = start_sims(args.engines, time_scale=args.time_scale, num_blocks=args.blocks, block_size=16,
                      model=MODEL, seed=args.seed)
    try:
        cfg = Config.from_dict({
            "listen": {"host": "127.0.0.1", "port": 0},
            "policy": {"name": policy},
            "models": {MODEL: {"tokenizer": "builtin", "block_size": 16}},
            "replicas": [{"id": f"e{i}", "url": s.url, "models": [MODEL], "capacity_blocks": args.blocks}
                         for i, s in enumerate(sims)],
            "scrape": {"interval_s": 0.5}, "logging": {"requests": False}})
        server = await Server(cfg, seed=args.seed).start()
        t0 = time.perf_counter()
        try:
            ok, failed = await replay(server.url, wl, args.concurrency, args.max_tokens)
        finally:
            await server.stop()
        wall = time.perf_counter() - t0
        counters = []
        for i, s in enumerate(sims):
            try:
                counters.append(engine_counters(s.url))
            except OSError as exc:
                raise SystemExit(f"engine e{i} ({s.url}) is not answering ({exc}); its log:\n{s.log()}") from None
    finally:
        stop_sims(sims)
    hits = sum(c["vllm:prefix_cache_hits_total"] for c in counters)
    queries = sum(c["vllm:prefix_cache_queries_total"] for c in counters)
    per = [c["vllm:request_success_total"] for c in counters]
    mean = sum(per) / len(per)
    return {"policy": policy, "hit_rate": hits / queries if queries else 0.0, "hits": hits, "queries": queries,
            "per_replica": per, "max_mean": max(per) / mean if mean else 0.0, "ok": ok, "failed": failed,
            "wall_s": wall}


async def main_async(args: argparse.Namespace) -> int:
    wl = workload(args.seed, args.tenants, args.sessions, args.turns, args.system_tokens, args.turn_tokens)
    results = [await run_policy(p, wl, args) for p in ("round_robin", "cache_aware")]
    rr, ca = results
    print(f"workload: {args.tenants} tenants x {args.sessions} sessions x {args.turns} turns "
          f"({args.system_tokens}-token system prompts, {args.turn_tokens}-token turns), "
          f"{args.engines} engines x {args.blocks} blocks of 16 tokens, concurrency {args.concurrency}, "
          f"seed {args.seed}")
    print(f"{'':32}{'round_robin':>16}{'cache_aware':>16}")
    rows = [("engine prefix-cache hit rate", lambda r: f"{r['hit_rate']:.1%}"),
            ("hit tokens / queried tokens", lambda r: f"{r['hits'] / 1e3:.0f}k/{r['queries'] / 1e3:.0f}k"),
            ("requests per engine", lambda r: "/".join(str(int(x)) for x in r["per_replica"])),
            ("max/mean requests per engine", lambda r: f"{r['max_mean']:.2f}"),
            ("requests ok / failed", lambda r: f"{r['ok']}/{r['failed']}"),
            ("wall time (s)", lambda r: f"{r['wall_s']:.1f}")]
    for label, fmt in rows:
        print(f"{label:32}{fmt(rr):>16}{fmt(ca):>16}")
    ratio = ca["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
    good = ratio >= 2.0 and ca["max_mean"] <= 1.3
    print(f"cache_aware / round_robin hit rate: {ratio:.2f}x (target >= 2x); cache_aware max/mean "
          f"{ca['max_mean']:.2f} (target <= 1.3) -> {'OK' if good else 'MISSED'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--blocks", type=int, default=2000, help="KV blocks per engine (16 tokens each)")
    p.add_argument("--tenants", type=int, default=32)
    p.add_argument("--sessions", type=int, default=4, help="sessions per tenant")
    p.add_argument("--turns", type=int, default=8, help="user turns per session")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--turn-tokens", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=64, help="answer length")
    p.add_argument("--concurrency", type=int, default=32, help="sessions in flight")
    p.add_argument("--time-scale", type=float, default=0.02,
                   help="sim time scale: 0.02 = 50x faster than the simulated GPU (0: no engine time)")
    p.add_argument("--seed", type=int, default=7)
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
