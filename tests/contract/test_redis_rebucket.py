"""Redis index: the bucket count follows the replica's capacity when it becomes known after
the first record (``set_capacity``), keeping every live entry (real Redis from the fixture)."""

from __future__ import annotations

import redis.asyncio as aioredis

from router.core.hashing import block_hashes, seed_hash
from router.index.redis import RedisIndex, buckets_for


def chain(tag: int, n: int, bs: int = 4) -> list[int]:
    toks = [tag + 1, 7] + list(range(n * bs))
    return block_hashes(toks[: n * bs], bs, seed_hash("m"))


async def _buckets(raw: aioredis.Redis, replica: str) -> tuple[int, int]:
    """(b:R in the meta hash, bucket keys that exist)."""
    nb = int(await raw.hget("rb:{m}:meta", f"b:{replica}"))
    keys = [k async for k in raw.scan_iter(match=f"rb:{{m}}:{replica}:*")]
    return nb, len(keys)


async def test_bucket_count_rederived_when_capacity_becomes_known(redis_server) -> None:
    raw = aioredis.from_url(redis_server.url)
    idx = RedisIndex(redis_server.url, namespace="rb", default_capacity=100_000, timeout_s=2.0)
    await idx.start()
    try:
        chains = [chain(i, 6) for i in range(5)]
        for c in chains:
            await idx.record("m", c, "r")
            await idx.record("m", c, "other")
        await idx.flush()
        assert (await _buckets(raw, "r"))[0] == buckets_for(100_000) == 1563

        idx.set_capacity("r", 64)  # the engine's capacity, scraped after the first records
        await idx.record("m", chain(9, 6), "r")
        await idx.flush()
        nb, keys = await _buckets(raw, "r")
        assert nb == buckets_for(64) == 1 and keys == 1
        for c in chains + [chain(9, 6)]:  # nothing lost in the move
            got = await idx.lookup("m", c)
            assert got.get("r") == 6 and got.get("other", 6) == 6
        assert (await _buckets(raw, "other"))[0] == 1563  # other replicas untouched

        idx.set_capacity("r", 6_400)  # and back up: entries kept again
        await idx.record("m", chain(10, 6), "r")
        await idx.flush()
        assert (await _buckets(raw, "r"))[0] == 100
        for c in chains + [chain(9, 6), chain(10, 6)]:
            assert (await idx.lookup("m", c)).get("r") == 6

        # cleared entries are not resurrected by the move
        await idx.clear("r")
        idx.set_capacity("r", 640)
        await idx.record("m", chain(11, 6), "r")
        await idx.flush()
        assert (await _buckets(raw, "r"))[0] == 10
        assert (await idx.lookup("m", chains[0])).get("r") is None
        assert (await idx.lookup("m", chain(11, 6))).get("r") == 6
    finally:
        await idx.close()
        await raw.aclose()
