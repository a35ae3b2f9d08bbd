"""One contract for every prefix index: the same cases against memory and a real Redis.

The Redis server is real (started by the ``redis_server`` fixture on a free port, or by the
test itself where the test stops and restarts it)."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.core.hashing import block_hashes, seed_hash
from router.index.memory import MemoryIndex
from router.index.redis import RedisIndex, buckets_for
from tests.support.services import RedisServer

BACKENDS = ["memory", "redis"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def chain(tag: int, n: int, model: str = "m", bs: int = 4) -> list[int]:
    toks = [tag % 251 + 1, tag // 251 + 1] + list(range(n * bs))
    return block_hashes(toks[: n * bs], bs, seed_hash(model))


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
async def make_index(backend, request):
    made: list = []
    clock = Clock()
    base_url = None
    if backend == "redis":
        import redis.asyncio as aioredis

        base_url = request.getfixturevalue("redis_server").url
        raw = aioredis.from_url(base_url)
        await raw.flushall()
        await raw.aclose()

    async def make(capacity: int = 100_000, ttl_s: float = 3600.0, url: str | None = None, **kw):
        if backend == "memory":
            idx = MemoryIndex(capacity, ttl_s=ttl_s, clock=clock, **kw)
        else:
            url = url or base_url
            idx = RedisIndex(url, namespace="t", ttl_s=ttl_s, default_capacity=capacity,
                             timeout_s=2.0, retry_s=0.2, **kw)  # 2 s: a loaded machine, not a dead Redis
        await idx.start()
        made.append(idx)
        return idx

    make.clock = clock  # type: ignore[attr-defined]
    yield make
    for idx in made:
        await idx.close()


async def test_lookup_returns_longest_consecutive_prefix(make_index) -> None:
    idx = await make_index()
    a = chain(1, 10)
    await idx.record("m", a[:6], "r0")
    await idx.record("m", a[:3], "r1")
    await idx.flush()
    assert await idx.lookup("m", a) == {"r0": 6, "r1": 3}
    assert await idx.lookup("m", a[:1]) == {"r0": 1, "r1": 1}
    assert await idx.lookup("m", chain(2, 10)) == {}
    assert await idx.lookup("m", chain(1, 10, model="other")) == {}
    assert await idx.lookup("m", []) == {}


async def test_long_chains_binary_search_exactly(make_index) -> None:
    idx = await make_index()
    a = chain(3, 8192)
    await idx.record("m", a, "r0")
    await idx.record("m", a[:5000], "r1")
    await idx.record("m", a[:1], "r2")
    await idx.flush()
    assert await idx.lookup("m", a) == {"r0": 8192, "r1": 5000, "r2": 1}
    assert await idx.lookup("m", a[:4999]) == {"r0": 4999, "r1": 4999, "r2": 1}


async def test_remove_and_clear(make_index) -> None:
    idx = await make_index()
    a = chain(4, 8)
    await idx.record("m", a, "r0")
    await idx.record("m", a, "r1")
    await idx.remove("r0", a[3:])  # engines evict a chain's tail first
    await idx.flush()
    assert await idx.lookup("m", a) == {"r0": 3, "r1": 8}
    await idx.clear("r1")
    assert await idx.lookup("m", a) == {"r0": 3}
    await idx.record("m", a[:2], "r1")
    await idx.flush()
    assert await idx.lookup("m", a) == {"r0": 3, "r1": 2}


async def test_rerecording_a_segment_restores_blocks_removed_from_its_middle(make_index) -> None:
    # exact tracking: the router records a whole chain; the engine, before serving it,
    # evicts a run of blocks (the removal applies: it is newer than the record); then it
    # recomputes them and its BlockStored (a ``stored`` record) covers that run up to the
    # chain's end, whose tail the router's record already wrote. Every block of it must be
    # held again.
    idx = await make_index()
    a = chain(9, 20)
    await idx.record("m", a, "r0")
    await idx.flush()
    await idx.remove("r0", a[9:14])
    assert await idx.lookup("m", a[:10]) == {"r0": 9}
    await idx.record("m", a[9:], "r0", stored=True)
    await idx.flush()
    assert await idx.lookup("m", a) == {"r0": 20}
    for i in range(20):  # each block, not only what a prefix search probes
        assert await idx.lookup("m", a[i:i + 1]) == {"r0": 1}, i


async def test_capacity_evicts_least_recently_used(make_index) -> None:
    idx = await make_index(capacity=16)
    a, b, c = chain(5, 8), chain(6, 8), chain(7, 8)
    await idx.record("m", a, "r0")
    await idx.record("m", b, "r0")
    await idx.record("m", a[:4], "r0")  # refresh a's head
    await idx.record("m", c, "r0")
    await idx.flush()
    assert await idx.lookup("m", c) == {"r0": 8}
    assert await idx.lookup("m", a) == {"r0": 4}
    assert await idx.lookup("m", b) == {"r0": 4}
    idx.set_capacity("r1", 8)
    await idx.record("m", a, "r1")
    await idx.record("m", b, "r1")
    await idx.flush()
    assert await idx.lookup("m", b) == {"r0": 4, "r1": 8}
    assert "r1" not in await idx.lookup("m", a)


async def test_ttl_drops_entries_not_rerecorded(make_index, backend) -> None:
    idx = await make_index(ttl_s=0.3)
    a = chain(8, 4)
    await idx.record("m", a, "r0")
    await idx.flush()
    assert await idx.lookup("m", a) == {"r0": 4}
    if backend == "memory":
        make_index.clock.t += 0.6
    else:
        await asyncio.sleep(0.6)
    assert await idx.lookup("m", a) == {}


async def test_two_clients_on_one_redis_share_placements(make_index, backend) -> None:
    if backend == "memory":
        pytest.skip("the memory index is per process by design")
    a_idx, b_idx = await make_index(), await make_index()
    a = chain(9, 12)
    await a_idx.record("m", a, "r2")
    await a_idx.flush()
    assert await b_idx.lookup("m", a) == {"r2": 12}
    await b_idx.clear("r2")
    assert await a_idx.lookup("m", a) == {}


async def test_redis_down_never_raises_and_resumes(make_index, backend) -> None:
    if backend == "memory":
        pytest.skip("nothing to lose")
    server = RedisServer().start()
    try:
        idx = await make_index(url=server.url)
        a = chain(10, 6)
        await idx.record("m", a, "r0")
        await idx.flush()
        assert await idx.lookup("m", a) == {"r0": 6}
        server.stop(kill=True)
        t0 = time.monotonic()
        for _ in range(50):
            assert await idx.lookup("m", a) == {}
        await idx.record("m", a, "r1")
        await idx.remove("r0", a)
        await idx.clear("r0")
        await idx.flush()
        assert time.monotonic() - t0 < 5.0  # the circuit answers at once, no retries
        assert not idx.up and idx.failures >= 1
        server.start()
        deadline = time.monotonic() + 10
        found: dict[str, int] = {}
        while time.monotonic() < deadline and not found:
            await asyncio.sleep(0.25)
            await idx.record("m", a, "r0")
            await idx.flush()
            found = await idx.lookup("m", a)
        assert found == {"r0": 6} and idx.up
    finally:
        server.stop()


async def test_redis_password_url(make_index, backend) -> None:
    if backend == "memory":
        pytest.skip("redis only")
    server = RedisServer(password="s3cret").start()
    try:
        idx = await make_index(url=server.url)
        a = chain(11, 3)
        await idx.record("m", a, "r0")
        await idx.flush()
        assert await idx.lookup("m", a) == {"r0": 3}
        bad = await make_index(url=server.url.replace("s3cret", "wrong"))
        assert await bad.lookup("m", a) == {}
    finally:
        server.stop()


BYTES_PER_ENTRY_BOUND = 40  # documented in router/index/redis.py and docs/routing.md


async def test_redis_memory_per_entry(make_index, backend) -> None:
    """Fill 4 replicas × 50,000 blocks and check bytes per (block, replica) entry."""
    if backend == "memory":
        pytest.skip("redis only")
    import redis.asyncio as aioredis

    idx = await make_index(capacity=50_000)
    raw = aioredis.from_url(idx.url)
    before = int((await raw.info("memory"))["used_memory"])
    n_rep, n_blocks = 4, 50_000
    for r in range(n_rep):
        hashes = chain(100 + r, n_blocks)
        for i in range(0, n_blocks, 5000):
            await idx.record("m", hashes[i: i + 5000], f"replica-{r}")
    await idx.flush()
    after = int((await raw.info("memory"))["used_memory"])
    per_entry = (after - before) / (n_rep * n_blocks)
    key = f"t:{{m}}:replica-0:{0}".encode()
    entries = await raw.hlen(key)
    usage = await raw.memory_usage(key)
    await raw.aclose()
    print(f"redis index: {per_entry:.1f} B/entry (used_memory), bucket of {entries} entries = {usage} B; "
          f"buckets/replica={buckets_for(50_000)}")
    assert entries > 0 and usage / entries <= BYTES_PER_ENTRY_BOUND
    assert per_entry <= BYTES_PER_ENTRY_BOUND
    assert await idx.lookup("m", chain(100, n_blocks)) == {"replica-0": n_blocks}
