"""Event sources added and dropped while the subscriber runs (config reload, admin API),
over real ZMQ sockets fed by the simulator's publisher; and the index bound the exact-aware
wrapper gives followed and approximate replicas."""

from __future__ import annotations

import asyncio
import time

from backends.kv_events import BlockStored
from backends.sim.kv_publisher import KVEventPublisher, KVEventsConfig
from router.core.hashing import block_hashes, seed_hash
from router.events import EventSource, EventSubscriber
from router.exact_index import EXACT_CAPACITY_FACTOR, ExactAwareIndex, exact_capacity
from router.index.memory import MemoryIndex
from tests.support.services import free_port

BS = 16


def toks(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt * 101) % 256 for i in range(n)]


def stored(tokens: list[int], engine_hashes: list[int]) -> BlockStored:
    return BlockStored(tuple(engine_hashes), None, tuple(tokens[: len(engine_hashes) * BS]), BS, None, "GPU")


async def held(index: MemoryIndex, replica: str, tokens: list[int]) -> int:
    return (await index.lookup("m", block_hashes(tokens, BS, seed_hash("m")))).get(replica, 0)


async def until_held(pub: KVEventPublisher, index: MemoryIndex, replica: str, tokens: list[int],
                     engine_hashes: list[int], timeout: float = 15.0) -> None:
    """Publish the chain until the index holds it (a new SUB subscription joins slowly)."""
    deadline = time.monotonic() + timeout
    while await held(index, replica, tokens) != len(engine_hashes):
        assert time.monotonic() < deadline, f"{replica} never indexed its blocks"
        await pub.publish([stored(tokens, engine_hashes)])
        await asyncio.sleep(0.1)


async def test_sources_added_and_dropped_on_a_shared_bound_socket():
    ep = f"tcp://127.0.0.1:{free_port()}"
    index = MemoryIndex(ttl_s=None)
    sub = EventSubscriber([EventSource("a", "m", BS, ep, None, "eng-a", bind=True)], index)
    await sub.start()
    pubs = {t: KVEventPublisher(KVEventsConfig(True, "zmq", ep, topic=f"eng-{t}")) for t in "abc"}
    try:
        for p in pubs.values():
            await p.start()
        await until_held(pubs["a"], index, "a", toks(32, 1), [1, 2])

        # added while running, on the socket already bound: followed from then on
        await sub.add_source(EventSource("b", "m", BS, ep, None, "eng-b", bind=True))
        assert sub.follows("b")
        await until_held(pubs["b"], index, "b", toks(32, 2), [3, 4])

        # dropped: cleared, no longer followed; the other replica on the socket still is
        await sub.drop_source("a")
        assert not sub.follows("a") and sub.replicas() == ["b"]
        assert await held(index, "a", toks(32, 1)) == 0
        await pubs["a"].publish([stored(toks(48, 5), [5, 6, 7])])
        await until_held(pubs["b"], index, "b", toks(48, 6), [8, 9, 10])
        assert await held(index, "a", toks(48, 5)) == 0

        # a source whose topic collides on the shared socket is refused
        try:
            await sub.add_source(EventSource("c", "m", BS, ep, None, "eng-b", bind=True))
        except ValueError:
            pass
        else:
            raise AssertionError("duplicate topic accepted")
        await sub.add_source(EventSource("c", "m", BS, ep, None, "eng-c", bind=True))
        await until_held(pubs["c"], index, "c", toks(32, 3), [11, 12])

        # the last replica on the socket dropped: the socket closes; its endpoint is free again
        await sub.drop_source("b")
        await sub.drop_source("c")
        assert sub.replicas() == []
        await sub.add_source(EventSource("a", "m", BS, ep, None, "eng-a", bind=True))
        await until_held(pubs["a"], index, "a", toks(32, 4), [13, 14])
    finally:
        await sub.close()
        for p in pubs.values():
            await p.close()


async def test_removed_replica_is_followed_again_when_re_added():
    ep = f"tcp://127.0.0.1:{free_port()}"
    index = MemoryIndex(ttl_s=None)
    src = EventSource("a", "m", BS, ep, None, "eng-a", bind=True)
    sub = EventSubscriber([src], index)
    await sub.start()
    pub = KVEventPublisher(KVEventsConfig(True, "zmq", ep, topic="eng-a"))
    try:
        await pub.start()
        await until_held(pub, index, "a", toks(32, 1), [1, 2])
        await sub.remove_replica("a")
        await pub.publish([stored(toks(32, 2), [3, 4])])
        await asyncio.sleep(0.5)
        assert await held(index, "a", toks(32, 2)) == 0 and not sub.follows("a")
        await sub.add_source(src)
        assert sub.follows("a")
        await until_held(pub, index, "a", toks(32, 3), [5, 6])
    finally:
        await sub.close()
        await pub.close()


async def test_followed_replicas_get_a_backstop_bound_approximate_ones_the_engines():
    inner = MemoryIndex(ttl_s=None)
    sub = EventSubscriber([EventSource("ev", "m", BS, "ipc:///tmp/kvr-unused-endpoint")], inner)
    idx = ExactAwareIndex(inner, sub, capacity_floor=1_000, engine_capacities={"ev": 64, "ap": 32})
    cap = inner.index.capacity
    assert cap("ev") == exact_capacity(64, 1_000) == 1_000 and cap("ap") == 32
    idx.set_capacity("ev", 500)  # scraped later
    assert cap("ev") == EXACT_CAPACITY_FACTOR * 500
    # router records beyond the engine's block count do not evict a followed replica's blocks
    first = block_hashes(toks(32, 0), BS, seed_hash("m"))
    await idx.record("m", first, "ev")
    for i in range(1, 300):
        await idx.record("m", block_hashes(toks(32, i), BS, seed_hash("m")), "ev")
    assert (await idx.lookup("m", first)).get("ev") == 2
    # left the pool: no longer followed, cleared, back to the engine's own bound
    await idx.remove_replica("ev")
    assert not sub.follows("ev") and cap("ev") == 500
    assert (await idx.lookup("m", first)).get("ev") is None
