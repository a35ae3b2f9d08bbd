"""Benchmark: the router's per-request cost of cache-aware routing, and its parts.

Prints, in one run (one process, loopback Redis started here, uvloop when installed):

* cache-aware routing of a 4,000-token multi-turn chat prompt — render the chat, tokenize
  (new turn only, thanks to the chunk cache), hash, ONE Redis lookup, the policy's choice,
  queue the record (the batched Redis write it causes is in the same process and counted)
  — in CPU-ms per request, for the built-in tokenizer and a BPE ``tokenizer.json``, next to
  the same path on a fresh prompt (nothing cached) and next to round_robin's choice;
* hashing 131,072 tokens (ms);
* one Redis lookup of 8,192 blocks with 8 replicas holding prefixes of it (wall ms).

Requests are routed 8 at a time (``--concurrency``; ``asyncio.gather``), as in a router with
requests in flight, where Redis round trips overlap and share event-loop wake-ups; one row
routes the BPE chat one request at a time (an idle router's cost, ~0.1 ms more).

``--repeat K`` runs every row K times, interleaved, and prints medians with the CPU-ms range;
``--breakdown`` adds the BPE + Redis path measured stage by stage (render, + tokenize and
hash, + lookup, + policy, + record); ``--baseline-tokenize FILE`` adds rows tokenized by
another version of ``router/tokenize.py``, interleaved, for a before/after in one run.

Targets (issues 4 and 9): ≤ 0.4 CPU-ms per cache-aware chat request, ≤ 5 ms to hash
131,072 tokens, ≤ 1 ms per 8,192-block lookup. Run: ``python -m loadtest.bench_routing``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from router.config import Config
from router.core.hashing import block_hashes, seed_hash
from router.core.scheduler import default_registry
from router.core.types import ReplicaState, RoutingRequest
from router.prefix import PrefixService

MODEL = "bench-model"
WORDS = ["the", "router", "sends", "each", "request", "to", "replica", "whose", "cache", "holds", "longest",
         "prefix", "of", "prompt", "tokens", "blocks", "hash", "chain", "engine", "prefill", "decode", "load"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) + (str(rng.randrange(100)) if rng.random() < 0.2 else "") for _ in range(n))


def train_tokenizer(directory: Path) -> Path:
    """A byte-level BPE (vocab 8,000) with a ChatML template, trained here (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(1)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator((words(rng, 200) for _ in range(2000)), trainers.BpeTrainer(
        vocab_size=8000, special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(directory / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template,
                                                                 "eos_token": "<|im_end|>"}))
    return directory


def chat_sessions(svc: PrefixService, target_tokens: int, n_sessions: int, seed: int) -> list[list[dict[str, str]]]:
    """Conversations whose rendered prompt is about ``target_tokens`` long (system + turns)."""
    rng = random.Random(seed)
    tok = svc.model(MODEL).tok
    assert tok is not None
    out = []
    for _ in range(n_sessions):
        msgs = [{"role": "system", "content": words(rng, 300)}]
        while len(tok.chat_ids(msgs) or []) < target_tokens - 150:
            msgs.append({"role": "user", "content": words(rng, 60)})
            msgs.append({"role": "assistant", "content": words(rng, 80)})
        out.append(msgs)
    return out


def make_config(tokenizer: str, redis_url: str | None, replicas: int) -> Config:
    index: dict[str, Any] = {"backend": "memory"}
    if redis_url:
        index = {"backend": "redis", "url": redis_url, "namespace": f"bench{random.randrange(1 << 30)}"}
    return Config.from_dict({
        "policy": {"name": "cache_aware"},
        "models": {MODEL: {"tokenizer": tokenizer, "block_size": 16}},
        "index": index,
        "replicas": [{"id": f"r{i}", "url": f"http://127.0.0.1:{9000 + i}", "models": [MODEL]}
                     for i in range(replicas)]})


STAGES = ("render the chat template", "+ tokenize and hash (annotate)", "+ Redis lookup", "+ policy choice",
          "+ queue the record (and its batched write)")


def load_module(path: str) -> Any:
    """Another version of ``router/tokenize.py`` (e.g. ``git show REV:router/tokenize.py``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("baseline_tokenize", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def route_cost(cfg: Config, fresh: bool, n: int, replicas: int, stage: int = 4,
                     tokenize_module: Any = None, concurrency: int = 1) -> tuple[float, float, int]:
    """CPU-ms and wall-ms per request of the cache-aware path; returns also the token count.
    ``stage`` < 4 stops each request early (see ``STAGES``): the breakdown of the path.
    ``tokenize_module``: tokenize with that module's ``load_tokenizer`` instead (A/B runs).
    ``concurrency``: requests routed at once (``asyncio.gather`` of that many), as in a router
    with requests in flight: their Redis round trips overlap and share event-loop wake-ups."""
    svc = PrefixService(cfg, CollectorRegistry())
    await svc.start()
    if tokenize_module is not None:
        svc.model(MODEL).tok = tokenize_module.load_tokenizer(cfg.model(MODEL).tokenizer)
    policy = default_registry().create("cache_aware", {})
    states = [ReplicaState(id=f"r{i}", models=(MODEL,)) for i in range(replicas)]
    rng = random.Random(0)
    sessions = chat_sessions(svc, 4000, 32, seed=5)
    turn_rng = random.Random(9)
    # warm: every session's history is placed and its chunks cached (as after earlier turns)
    for s in sessions:
        req = RoutingRequest(model=MODEL)
        await svc.annotate("/v1/chat/completions", {"model": MODEL, "messages": s}, req)
        d = policy.choose(req, states, await svc.lookup(req), rng)
        svc.record(req, d.replica)
    await svc.index.flush()
    bodies = []
    for i in range(n):
        if fresh:
            msgs = [{"role": "system", "content": words(turn_rng, 2200)}]  # nothing cached anywhere
        else:
            msgs = sessions[i % len(sessions)] + [{"role": "user", "content": words(turn_rng, 60)}]
        bodies.append({"model": MODEL, "messages": msgs})
    ntok = 0
    tok = svc.model(MODEL).tok
    assert tok is not None

    async def route(body: dict[str, Any]) -> None:
        nonlocal ntok
        if stage == 0:
            tok._render(body["messages"], True, {})
            return
        req = RoutingRequest(model=MODEL)
        await svc.annotate("/v1/chat/completions", body, req)
        ntok += req.num_tokens
        if stage == 1:
            return
        matches = await svc.lookup(req)
        if stage == 2:
            return
        d = policy.choose(req, states, matches, rng)
        if stage == 3:
            return
        svc.record(req, d.replica)

    c0, t0 = time.process_time(), time.perf_counter()
    if concurrency <= 1:
        for body in bodies:
            await route(body)
    else:
        for i in range(0, len(bodies), concurrency):
            await asyncio.gather(*(route(b) for b in bodies[i:i + concurrency]))
    await svc.index.flush()
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    await svc.close()
    return cpu / n * 1e3, wall / n * 1e3, ntok // n


def round_robin_cost(n: int, replicas: int) -> float:
    policy = default_registry().create("round_robin", {})
    states = [ReplicaState(id=f"r{i}", models=(MODEL,)) for i in range(replicas)]
    rng = random.Random(0)
    c0 = time.process_time()
    for _ in range(n):
        policy.choose(RoutingRequest(model=MODEL), states, {}, rng)
    return (time.process_time() - c0) / n * 1e3


def hash_cost(tokens: int = 131_072, reps: int = 20) -> float:
    ids = [random.randrange(128_000) for _ in range(tokens)]
    seed = seed_hash(MODEL)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        block_hashes(ids, 16, seed)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


async def lookup_cost(redis_url: str, blocks: int = 8192, replicas: int = 8, n: int = 200) -> tuple[float, float, dict]:
    from router.index.redis import RedisIndex

    idx = RedisIndex(redis_url, namespace="bench-lookup", default_capacity=100_000)
    await idx.start()
    hashes = block_hashes(list(range(blocks * 16)), 16, seed_hash(MODEL))
    for r in range(replicas):
        await idx.record(MODEL, hashes[: blocks - r * (blocks // replicas)], f"r{r}")
    await idx.flush()
    found = await idx.lookup(MODEL, hashes)
    times = []
    c0 = time.process_time()
    for _ in range(n):
        t0 = time.perf_counter()
        await idx.lookup(MODEL, hashes)
        times.append(time.perf_counter() - t0)
    cpu = (time.process_time() - c0) / n * 1e3
    await idx.close()
    return statistics.median(times) * 1e3, cpu, found


async def main_async(args: argparse.Namespace) -> int:
    from loadtest.procs import RedisServer

    redis = RedisServer().start() if not args.redis_url else None
    url = args.redis_url or redis.url  # type: ignore[union-attr]
    try:
        with tempfile.TemporaryDirectory() as d:
            bpe = str(train_tokenizer(Path(d)))
            c = args.concurrency
            cases = [
                ("builtin tokenizer, chat + new turn, Redis", "builtin", url, False, c),
                ("BPE tokenizer.json, chat + new turn, Redis", bpe, url, False, c),
                ("  same, 1 request at a time", bpe, url, False, 1),
                ("BPE tokenizer.json, chat + new turn, memory", bpe, None, False, c),
                ("BPE tokenizer.json, fresh 4k prompt, Redis", bpe, url, True, c),
            ]
            alt = load_module(args.baseline_tokenize) if args.baseline_tokenize else None
            if alt is not None:
                cases.insert(3, ("  same, baseline tokenize.py", bpe, url, False, c))
                cases.insert(1, ("  same, baseline tokenize.py", "builtin", url, False, c))
            runs: list[list[tuple[int, float, float]]] = [[] for _ in cases]
            stages: list[list[float]] = [[] for _ in STAGES]
            for _ in range(args.repeat):  # rows interleaved: a load change hits them all alike
                for k, (_label, tok, backend, fresh, conc) in enumerate(cases):
                    cpu, wall, ntok = await route_cost(make_config(tok, backend, args.replicas), fresh,
                                                       args.requests, args.replicas,
                                                       tokenize_module=alt if "baseline" in _label else None,
                                                       concurrency=conc)
                    runs[k].append((ntok, cpu, wall))
                if args.breakdown:
                    for st in range(len(STAGES)):
                        cpu, _, _ = await route_cost(make_config(bpe, url, args.replicas), False,
                                                     args.requests // 2, args.replicas, stage=st,
                                                     concurrency=args.concurrency)
                        stages[st].append(cpu)
            rows = [(label, r[0][0], statistics.median(x[1] for x in r), statistics.median(x[2] for x in r),
                     min(x[1] for x in r), max(x[1] for x in r)) for (label, *_), r in zip(cases, runs, strict=True)]
        rr = round_robin_cost(args.requests * 10, args.replicas)
        h = hash_cost()
        lk_wall, lk_cpu, found = await lookup_cost(url)
    finally:
        if redis is not None:
            redis.stop()
    import os

    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
          "(CPU-ms rise with it on a shared machine: compare runs at similar load)")
    print(f"cache-aware routing cost per request ({args.replicas} replicas, {args.requests} requests each, "
          f"{args.concurrency} routed at once unless said, median of {args.repeat} run(s), CPU-ms range over "
          "the runs):")
    print(f"  {'path':<46} {'tokens':>7} {'CPU-ms':>8} {'wall-ms':>8} {'CPU-ms range':>14}")
    for label, ntok, cpu, wall, lo, hi in rows:
        print(f"  {label:<46} {ntok:>7} {cpu:>8.3f} {wall:>8.3f} {lo:>6.3f}-{hi:<7.3f}")
    print(f"  {'round_robin choice alone (for scale)':<46} {'-':>7} {rr:>8.4f}")
    if args.breakdown:
        print("where the BPE + Redis path goes (cumulative stages, median CPU-ms per request; the step is "
              "the difference):")
        prev = 0.0
        for name, vals in zip(STAGES, stages, strict=True):
            med = statistics.median(vals)
            print(f"  {name:<46} {med:>8.3f}  step {med - prev:+.3f}")
            prev = med
    by_label = {r[0]: r for r in rows}
    builtin = rows[0][2]
    target = by_label["BPE tokenizer.json, chat + new turn, Redis"][2]
    seq = by_label["  same, 1 request at a time"][2]
    print(f"target: cache-aware 4k-token chat <= 0.4 CPU-ms ({args.concurrency} in flight): BPE {target:.3f} ms, "
          f"builtin {builtin:.3f} ms -> {'OK' if max(target, builtin) <= 0.4 else 'MISSED'} (BPE one request at "
          f"a time, an idle router's cost: {seq:.3f} ms -> {'OK' if seq <= 0.4 else 'over'}); "
          f"fresh/cached ratio {by_label['BPE tokenizer.json, fresh 4k prompt, Redis'][2] / target:.1f}x")
    if alt is not None:
        print(f"baseline tokenize.py / this one (medians): builtin {rows[1][2] / builtin:.2f}x, "
              f"BPE {rows[4][2] / target:.2f}x")
    print(f"hashing 131,072 tokens: {h:.2f} ms (target <= 5 ms) -> {'OK' if h <= 5 else 'MISSED'}")
    print(f"Redis lookup of 8,192 blocks, 8 replicas matching {sorted(found.values())}: {lk_wall:.3f} ms wall "
          f"(median), {lk_cpu:.3f} CPU-ms in the router (target <= 1 ms) -> {'OK' if lk_wall <= 1 else 'MISSED'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8,
                   help="requests routed at once (default 8, a router with requests in flight); one row is "
                        "always measured 1 at a time")
    p.add_argument("--repeat", type=int, default=1, help="runs of every row, interleaved (median and range)")
    p.add_argument("--breakdown", action="store_true", help="also measure the BPE path stage by stage")
    p.add_argument("--baseline-tokenize", default=None, metavar="FILE",
                   help="another router/tokenize.py (git show REV:router/tokenize.py > FILE): adds rows routed "
                        "with it, interleaved with this one's, for a before/after in one run")
    p.add_argument("--redis-url", default=None, help="an existing Redis (default: start one on a free port)")
    args = p.parse_args(argv)
    try:
        import uvloop

        return uvloop.run(main_async(args))
    except ImportError:
        return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
