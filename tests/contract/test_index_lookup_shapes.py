"""The Redis lookup script's search (block 1 for every replica, then pivots on lengths already
found for other replicas, then a binary search) answers exactly what the memory index does,
on seeded random workloads: replicas holding different lengths of shared chains (a system
prompt every conversation starts with), replicas holding chain segments without their first
block, tails removed as engines evict them, cleared replicas. Real Redis from the fixture.

Removals only take a conversation's own tail (never the shared system prompt's blocks), as
engines evict leaves first: present blocks stay prefix-closed, which the search relies on
(see :mod:`router.index.redis`)."""

from __future__ import annotations

import asyncio
import random

import pytest

from router.core.hashing import block_hashes, seed_hash
from router.index.memory import MemoryIndex
from router.index.redis import RedisIndex

BS = 4
SYSTEM_BLOCKS = 8
REPLICAS = [f"r{i}" for i in range(12)]


def _chains(rng: random.Random, conversations: int) -> tuple[list[list[int]], list[list[int]]]:
    """Conversations sharing a system prompt, and chains whose heads nobody ever records."""
    seed = seed_hash("m")
    system = [rng.randrange(50_000) for _ in range(SYSTEM_BLOCKS * BS)]
    convs = []
    for _ in range(conversations):
        own = [rng.randrange(50_000) for _ in range(rng.randrange(1, 50) * BS)]
        convs.append(block_hashes(system + own, BS, seed))
    headless = [block_hashes([rng.randrange(50_000) for _ in range(40 * BS)], BS, seed) for _ in range(3)]
    return convs, headless


def _length(rng: random.Random, chain: list[int], found: list[int]) -> int:
    """A recorded length: often one another replica has (the search's pivots), L ± 1, the
    system prompt, the whole chain, or anything."""
    n = len(chain)
    pick = rng.random()
    if pick < 0.3 and found:
        return max(1, min(n, rng.choice(found) + rng.choice((-1, 0, 0, 1))))
    if pick < 0.45:
        return min(n, SYSTEM_BLOCKS + rng.choice((-1, 0, 1)))
    if pick < 0.6:
        return n
    return rng.randrange(1, n + 1)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_redis_lookup_equals_memory_on_random_workloads(redis_url, seed) -> None:
    rng = random.Random(seed)
    convs, headless = _chains(rng, 10)
    mem = MemoryIndex(1_000_000, ttl_s=None)
    red = RedisIndex(redis_url, namespace=f"shapes{seed}", default_capacity=1_000_000, timeout_s=2.0)
    await red.start()
    found: list[int] = []
    compared = 0
    try:
        for _step in range(40):
            for _ in range(rng.randrange(1, 8)):
                op = rng.random()
                r = rng.choice(REPLICAS)
                chain = rng.choice(convs)
                if op < 0.55:
                    k = _length(rng, chain, found)
                    stored = rng.random() < 0.3
                    for idx in (mem, red):
                        await idx.record("m", chain[:k], r, stored=stored)
                elif op < 0.7:  # blocks past the head only (e.g. an engine's later KV event)
                    h = rng.choice(headless)
                    a = rng.randrange(1, len(h) - 1)
                    for idx in (mem, red):
                        await idx.record("m", h[a:rng.randrange(a + 1, len(h) + 1)], r, stored=True)
                elif op < 0.9 and len(chain) > SYSTEM_BLOCKS + 1:  # evict a conversation's tail
                    j = rng.randrange(SYSTEM_BLOCKS, len(chain))
                    for idx in (mem, red):
                        await idx.remove(r, chain[j:])
                elif op >= 0.9:
                    for idx in (mem, red):
                        await idx.clear(r)
            await red.flush()
            for chain in [*rng.sample(convs, 4), rng.choice(headless)]:
                q = chain[: rng.choice((len(chain), rng.randrange(1, len(chain) + 1)))]
                want = await mem.lookup("m", q)
                got = await red.lookup("m", q)
                assert got == want, (seed, _step, len(q))
                found = sorted(set(want.values()))
                compared += 1
        assert compared == 200
    finally:
        await red.close()


async def test_redis_lookup_shapes(redis_url) -> None:
    """The shapes one by one: different lengths, the same length, a replica without block 1
    but with the rest, a cleared replica, a replica that holds nothing of this model."""
    convs, _ = _chains(random.Random(9), 2)
    a = convs[0] if len(convs[0]) > 20 else convs[0] + convs[1][SYSTEM_BLOCKS:]
    n = len(a)
    red = RedisIndex(redis_url, namespace="shapes", default_capacity=1_000_000, timeout_s=2.0)
    await red.start()
    try:
        lengths = {"r0": n, "r1": SYSTEM_BLOCKS, "r2": SYSTEM_BLOCKS, "r3": SYSTEM_BLOCKS + 1,
                   "r4": n - 1, "r5": 1, "r6": 2, "r7": n}
        for r, k in lengths.items():
            await red.record("m", a[:k], r)
        await red.record("m", a[1:], "r8", stored=True)  # everything but block 1
        await red.record("m", a, "r9")
        await red.record("m", convs[1], "r10")           # another conversation only
        await red.flush()
        await red.clear("r9")
        assert await red.lookup("m", a) == lengths | {"r10": SYSTEM_BLOCKS}
        assert await red.lookup("m", a[:SYSTEM_BLOCKS]) == {r: min(k, SYSTEM_BLOCKS) for r, k in lengths.items()} | {
            "r10": SYSTEM_BLOCKS}
        await red.remove("r0", a[SYSTEM_BLOCKS + 2:])
        assert (await red.lookup("m", a))["r0"] == SYSTEM_BLOCKS + 2
    finally:
        await red.close()


async def test_record_after_lookup_packs_the_hashes_once(redis_url, monkeypatch) -> None:
    """The record that follows a routing decision reuses the lookup's packed hashes (the same
    list object); another list, or the same list grown since, is packed again."""
    import router.index.redis as redis_mod

    calls: list[int] = []
    real = redis_mod.pack_hashes
    monkeypatch.setattr(redis_mod, "pack_hashes", lambda hs: calls.append(len(hs)) or real(hs))
    idx = RedisIndex(redis_url, namespace=f"pack{random.randrange(1 << 30)}")
    await idx.start()
    try:
        chain = block_hashes(list(range(64)), BS, seed_hash("m"))
        await idx.lookup("m", chain)
        idx.record_nowait("m", chain, "r0")
        assert calls == [16]
        idx.record_nowait("m", list(chain), "r1")  # an equal but other list: packed
        chain.append(12345)  # the looked-up list, grown: packed again, with the new block
        idx.record_nowait("m", chain, "r2")
        assert calls == [16, 16, 17]
        await idx.flush()
        assert await idx.lookup("m", chain[:16]) == {"r0": 16, "r1": 16, "r2": 16}
        # lookups in flight together: each one's record still reuses its own packing
        calls.clear()
        a = block_hashes(list(range(100, 164)), BS, seed_hash("m"))
        b = block_hashes(list(range(200, 264)), BS, seed_hash("m"))

        async def route(hs: list[int], rep: str) -> None:
            await idx.lookup("m", hs)
            idx.record_nowait("m", hs, rep)

        await asyncio.gather(route(a, "r3"), route(b, "r4"))
        assert calls == [16, 16]
    finally:
        await idx.close()
