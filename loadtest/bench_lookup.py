"""Benchmark: one Redis index lookup of a long prompt (8,192 blocks = 131,072 tokens) with
8 vs 64 replicas, side by side in one run (issue 9: the lookup must not grow with the fleet).

A Redis is started here on a free loopback port (``loadtest.procs.RedisServer``). Each fleet
(8 and 64 replicas) lives in its own namespace of that Redis and is filled through the
index's real record path (:class:`router.index.redis.RedisIndex` ``record`` → the batched
record script) at a realistic capacity (``--capacity`` blocks per replica, 20,000 by
default: an 80 GB GPU serving an 8B model holds ~10,000–30,000 blocks of 16 tokens), so
bucket hashes have their production size. Before the scenarios, every replica is filled to
its capacity with chains of other prompts (what a busy fleet holds). Then, per scenario,
the prompt's chain is recorded as the scenario says and looked up ``--runs`` times,
alternating 8 and 64 replicas (same machine load for both):

* ``a. 1-2 holders``: one replica holds the whole chain, one other its first half; the
  rest hold other chains only (cache-aware routing's normal state);
* ``b. shared system prompt``: every replica holds the first ``--system-blocks`` blocks
  (64 by default, a 1,024-token system prompt), one replica the whole chain;
* ``c. all hold it``: every replica holds the whole chain;
* ``d. all different``: every replica holds a different length of the chain (worst case).

Every answer is checked against what was recorded. The table prints the wall time of one
``lookup`` call (EVALSHA round trip + decoding) in ms, median and p90, for both fleets, the
ratio 64/8 of the medians, and the ``HGET``s the script made (counted by a copy of it run
once: the figure machine load does not blur). ``--baseline FILE`` adds rows for the ``LOOKUP_LUA`` of
another version of ``router/index/redis_scripts.py`` (same keys, same data, interleaved),
e.g. ``git show HEAD~3:router/index/redis_scripts.py > /tmp/old.py``.

Target (issue 9): ≤ 1 ms per 8,192-block lookup on loopback, not growing with replicas.
Run: ``python -m loadtest.bench_lookup [--runs 300] [--capacity 20000] [--baseline FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import runpy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.core.hashing import block_hashes, seed_hash
from router.index.redis import LOOKUP_LUA, RedisIndex, pack_hashes

MODEL = "bench-model"
FLEETS = (8, 64)


@dataclass
class Scenario:
    name: str
    # (fleet size, chain) -> [(replica, blocks recorded)] in record order
    placements: Callable[[int, Sequence[int]], list[tuple[str, int]]]


def _scenarios(blocks: int, system_blocks: int, seed: int) -> list[Scenario]:
    def a(n: int, c: Sequence[int]) -> list[tuple[str, int]]:
        return [("r0", blocks), ("r1", blocks // 2)]

    def b(n: int, c: Sequence[int]) -> list[tuple[str, int]]:
        return [(f"r{r}", system_blocks) for r in range(n)] + [("r0", blocks)]

    def c_(n: int, c: Sequence[int]) -> list[tuple[str, int]]:
        return [(f"r{r}", blocks) for r in range(n)]

    def d(n: int, c: Sequence[int]) -> list[tuple[str, int]]:
        lengths = random.Random(seed + n).sample(range(1, blocks + 1), n)
        return [(f"r{r}", length) for r, length in enumerate(lengths)]

    return [Scenario("a. 1-2 holders", a), Scenario("b. shared system prompt", b),
            Scenario("c. all hold it", c_), Scenario("d. all different", d)]


def _chain(tag: int, blocks: int) -> list[int]:
    return block_hashes([tag, tag >> 8, *range(blocks * 16 - 2)], 16, seed_hash(MODEL))


async def _fill_background(idx: RedisIndex, replicas: int, capacity: int, rng: random.Random,
                           chain_blocks: int = 2048) -> None:
    """Each replica records other prompts' chains up to its capacity (random hashes: only
    their count and spread over buckets matter)."""
    for r in range(replicas):
        for _ in range(0, capacity, chain_blocks):
            idx.record_nowait(MODEL, [rng.getrandbits(64) for _ in range(chain_blocks)], f"r{r}")
        await idx.flush()


def _expected(placements: list[tuple[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for rep, n in placements:
        out[rep] = max(out.get(rep, 0), n)
    return out


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _load_baseline(idx: RedisIndex, text: str) -> RedisIndex:
    """A second index on the same keys whose lookup runs ``text`` (another LOOKUP_LUA)."""
    old = RedisIndex(idx.url, namespace=idx.ns, default_capacity=idx.default_capacity, timeout_s=idx.timeout_s)
    await old.client.script_load(text)
    old._lookup_sha = hashlib.sha1(text.encode()).hexdigest().encode()
    await old.start()
    return old


async def _probes(idx: RedisIndex, text: str, chain: Sequence[int]) -> int:
    """How many ``HGET``s the lookup script ``text`` makes for ``chain`` (a counting copy of
    it, run once with EVAL): the cost that machine load does not blur."""
    counting = ("local probes = 0\nlocal function counted(...) probes = probes + 1 return redis.call(...) end\n"
                + text.replace("redis.call('HGET'", "counted('HGET'").replace("\nreturn out\n", "\nreturn probes\n"))
    keys, prefix = idx._keys(MODEL)
    return int(await idx.client.eval(counting, 1, keys[0], pack_hashes(chain), prefix))


async def main_async(args: argparse.Namespace) -> int:
    from loadtest.procs import RedisServer

    server = RedisServer().start() if not args.redis_url else None
    url = args.redis_url or server.url  # type: ignore[union-attr]
    indexes: dict[int, RedisIndex] = {}
    baselines: dict[int, RedisIndex] = {}
    failed = False
    try:
        rng = random.Random(args.seed)
        baseline_text = runpy.run_path(args.baseline)["LOOKUP_LUA"] if args.baseline else None
        t0 = time.perf_counter()
        for n in FLEETS:
            idx = RedisIndex(url, namespace=f"bench-lookup-{n}", default_capacity=args.capacity, timeout_s=5.0)
            await idx.start()
            indexes[n] = idx
            await _fill_background(idx, n, args.capacity, rng)
            if baseline_text:
                baselines[n] = await _load_baseline(idx, baseline_text)
        print(f"filled {' and '.join(map(str, FLEETS))} replicas × {args.capacity:,} blocks of other "
              f"prompts in {time.perf_counter() - t0:.1f} s; lookups of {args.blocks:,} blocks, "
              f"{args.runs} runs each, 8 and 64 interleaved")
        rows = []
        for k, sc in enumerate(_scenarios(args.blocks, args.system_blocks, args.seed)):
            chain = _chain(1000 + k, args.blocks)
            want: dict[int, dict[str, int]] = {}
            for n, idx in indexes.items():
                placements = sc.placements(n, chain)
                for rep, m in placements:
                    idx.record_nowait(MODEL, chain[:m], rep)
                await idx.flush()
                want[n] = _expected(placements)
            variants = [("", indexes)] + ([(" (baseline)", baselines)] if baselines else [])
            texts = {"": LOOKUP_LUA, " (baseline)": baseline_text or ""}
            times: dict[tuple[str, int], list[float]] = {(v, n): [] for v, _ in variants for n in FLEETS}
            for _ in range(args.runs):
                for v, group in variants:
                    for n in FLEETS:
                        t = time.perf_counter()
                        got = await group[n].lookup(MODEL, chain)
                        times[(v, n)].append((time.perf_counter() - t) * 1e3)
                        if got != want[n]:
                            failed = True
                            print(f"WRONG ANSWER {sc.name}{v} {n} replicas: {len(got)} replicas found, "
                                  f"{sum(1 for r, x in got.items() if want[n].get(r) != x)} differ")
            for v, _ in variants:
                t8, t64 = times[(v, 8)], times[(v, 64)]
                probes = [await _probes(indexes[n], texts[v], chain) for n in FLEETS]
                rows.append((sc.name + v, statistics.median(t8), _pct(t8, 0.9),
                             statistics.median(t64), _pct(t64, 0.9), *probes))
        print(f"\n{'scenario':34} {'8 replicas ms':>16} {'64 replicas ms':>16} {'64/8':>6} {'HGETs 8 / 64':>14}")
        print(f"{'':34} {'median':>8}{'p90':>8} {'median':>8}{'p90':>8}")
        for name, m8, p8, m64, p64, h8, h64 in rows:
            print(f"{name:34} {m8:8.3f}{p8:8.3f} {m64:8.3f}{p64:8.3f} {m64 / m8:6.2f} {h8:>6} / {h64:<6}")
        print("\ntarget: ≤ 1 ms per lookup of 8,192 blocks on loopback (issue 9)")
    finally:
        for idx in [*indexes.values(), *baselines.values()]:
            await idx.close()
        if server is not None:
            server.stop()
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=300, help="lookups per scenario and fleet (default 300)")
    p.add_argument("--blocks", type=int, default=8192, help="blocks in the looked-up prompt (default 8192)")
    p.add_argument("--capacity", type=int, default=20_000, help="blocks per replica (default 20000)")
    p.add_argument("--system-blocks", type=int, default=64, help="shared system prompt blocks, scenario b")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--baseline", metavar="FILE", help="another redis_scripts.py whose LOOKUP_LUA is timed too")
    p.add_argument("--redis-url", help="use this Redis instead of starting one (it must be empty)")
    args = p.parse_args(argv)
    if args.capacity < args.blocks:
        p.error("--capacity must hold the whole prompt (≥ --blocks)")
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main_async(args))
    return uvloop.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
