"""The subscriber over real ZMQ sockets (loopback / ipc), fed by the simulator's publisher:
connect and bind modes, seq gaps with replay, replay unavailable, engine restart, decode
errors, the memory and Redis indexes, and exact-vs-approximate precedence."""

from __future__ import annotations

import asyncio
import struct
import tempfile
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from backends.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, sglang_block_hashes
from backends.sim.kv_publisher import KVEventPublisher, KVEventsConfig
from router.core.hashing import block_hashes, seed_hash
from router.events import EventSource, EventSubscriber
from router.exact_index import ExactAwareIndex
from router.index.memory import MemoryIndex
from tests.support.services import free_port

BS = 16


def toks(n: int, salt: int = 0) -> list[int]:
    return [(i * 37 + salt * 101) % 256 for i in range(n)]


def router_chain(tokens: list[int], model: str = "m") -> list[int]:
    return block_hashes(tokens, BS, seed_hash(model))


def stored_chain(tokens: list[int], engine_hashes: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(tuple(engine_hashes), parent, tuple(tokens[: len(engine_hashes) * BS]), BS, None, "GPU")


async def eventually(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def ipc_pair() -> tuple[str, str]:
    d = Path(tempfile.mkdtemp(prefix="kvr-ev-"))
    return f"ipc://{d}/pub", f"ipc://{d}/replay"


async def start_pair(encoding: str = "map", *, replay: bool = True, index=None, topic: str = "",
                     replay_timeout_s: float = 2.0):
    pub_ep, rep_ep = ipc_pair()
    pub = KVEventPublisher(KVEventsConfig(True, "zmq", pub_ep, rep_ep if replay else None,
                                          topic=topic, encoding=encoding))
    await pub.start()
    index = index or MemoryIndex(ttl_s=None)
    sub = EventSubscriber([EventSource("r0", "m", BS, pub_ep, rep_ep if replay else None, topic)], index,
                          replay_timeout_s=replay_timeout_s)
    await sub.start()
    await sync(pub, sub)
    return pub, sub, index


async def sync(pub: KVEventPublisher, sub: EventSubscriber, replica: str = "r0") -> None:
    """Publish empty batches until the (slow-joining) SUB socket sees one."""
    deadline = time.monotonic() + 10
    while sub.stats(replica).batches == 0:
        assert time.monotonic() < deadline, "subscriber never received a message"
        await pub.publish([])
        await asyncio.sleep(0.05)
    await sub.idle()


async def held(index: MemoryIndex, replica: str, hashes: list[int]) -> int:
    return (await index.lookup("m", hashes)).get(replica, 0)


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_store_remove_clear_connect_mode(encoding):
    pub, sub, index = await start_pair(encoding)
    try:
        t = toks(64)
        eng = sglang_block_hashes(t, BS)  # any engine hash works: the router re-hashes
        await pub.publish([stored_chain(t[:32], eng[:2])])
        await pub.publish([stored_chain(t[32:], eng[2:], parent=eng[1])])
        rh = router_chain(t)
        await eventually(lambda: _eq(held(index, "r0", rh), 4))
        await pub.publish([BlockRemoved((eng[3],), "GPU"), BlockRemoved((eng[2],), "GPU")])
        await eventually(lambda: _eq(held(index, "r0", rh), 2))
        await pub.publish([AllBlocksCleared()])
        await eventually(lambda: _eq(held(index, "r0", rh), 0))
        st = sub.stats("r0")
        assert st.gaps == 0 and st.decode_errors == 0 and index.index.size("r0") == 0
    finally:
        await sub.close()
        await pub.close()


async def _eq(coro, want) -> bool:
    return (await coro) == want


async def test_gap_is_replayed_and_index_converges():
    pub, sub, index = await start_pair()
    try:
        t = toks(96, 1)
        eng = list(range(1000, 1006))
        await pub.publish([stored_chain(t[:32], eng[:2])])
        # two batches only buffered, never sent: the subscriber sees a gap
        await pub.publish([stored_chain(t[32:64], eng[2:4], parent=eng[1])], send=False)
        await pub.publish([BlockRemoved((eng[0] + 999,), "GPU")], send=False)
        await pub.publish([stored_chain(t[64:], eng[4:], parent=eng[3])])
        await eventually(lambda: _eq(held(index, "r0", router_chain(t)), 6))
        st = sub.stats("r0")
        assert st.gaps == 1 and st.replays >= 1 and st.replay_failures == 0
        assert st.last_seq == pub.seq - 1
    finally:
        await sub.close()
        await pub.close()


async def test_gap_without_replay_clears_the_replica_and_resumes():
    pub, sub, index = await start_pair(replay=False)
    try:
        t = toks(64, 2)
        await pub.publish([stored_chain(t[:32], [1, 2])])
        await eventually(lambda: _eq(held(index, "r0", router_chain(t)), 2))
        await pub.publish([BlockRemoved((2,), "GPU")], send=False)  # lost eviction
        t2 = toks(32, 3)
        await pub.publish([stored_chain(t2, [7, 8])])
        await eventually(lambda: _eq(held(index, "r0", router_chain(t2)), 2))
        # the stale chain is gone (cleared), the new one is tracked
        assert await held(index, "r0", router_chain(t)) == 0
        assert sub.stats("r0").gaps == 1
    finally:
        await sub.close()
        await pub.close()


@pytest.mark.parametrize("continue_seq", [False, True])
async def test_engine_restart_clears(continue_seq):
    """A restarted engine clears its replica, whether its seq restarts at 0 or (worst case)
    happens to continue where the old one stopped: the replay identity check catches it."""
    pub, sub, index = await start_pair()
    try:
        t = toks(32, 4)
        await pub.publish([stored_chain(t, [1, 2])])
        await eventually(lambda: _eq(held(index, "r0", router_chain(t)), 2))
        # the engine restarts: a new publisher (seq from 0) on the same endpoints
        await pub.close()
        old_seq = pub.seq
        pub = KVEventPublisher(pub.config)
        if continue_seq:
            pub.seq = old_seq
        await pub.start()
        t2 = toks(32, 5)
        deadline = time.monotonic() + 10
        while await held(index, "r0", router_chain(t2)) != 2:
            assert time.monotonic() < deadline
            await pub.publish([stored_chain(t2, [3, 4])])
            await asyncio.sleep(0.05)
        assert await held(index, "r0", router_chain(t)) == 0
    finally:
        await sub.close()
        await pub.close()


async def test_router_start_replays_the_engine_buffer():
    """A subscriber that starts after the engine rebuilds from the replay buffer."""
    pub_ep, rep_ep = ipc_pair()
    pub = KVEventPublisher(KVEventsConfig(True, "zmq", pub_ep, rep_ep))
    await pub.start()
    t = toks(48, 6)
    await pub.publish([stored_chain(t, [11, 12, 13])])
    await pub.publish([BlockRemoved((13,), "GPU")])
    index = MemoryIndex(ttl_s=None)
    sub = EventSubscriber([EventSource("r0", "m", BS, pub_ep, rep_ep)], index)
    await sub.start()
    try:
        await sync(pub, sub)
        assert await held(index, "r0", router_chain(t)) == 2
    finally:
        await sub.close()
        await pub.close()


async def test_malformed_payload_counted_never_fatal(caplog):
    caplog.set_level("WARNING", logger="kvrouter.events")
    pub_ep, rep_ep = ipc_pair()
    index = MemoryIndex(ttl_s=None)
    sub = EventSubscriber([EventSource("r0", "m", BS, pub_ep)], index)
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.PUB)
    raw.bind(pub_ep)
    await sub.start()
    try:
        from backends.kv_events import EventBatch, encode_payload

        good = encode_payload(EventBatch(time.time(), (stored_chain(toks(16), [5]),)))
        seq = 0
        deadline = time.monotonic() + 10
        while sub.stats("r0").batches == 0:  # slow joiner
            assert time.monotonic() < deadline
            await raw.send_multipart([b"", struct.pack(">Q", seq), encode_payload(EventBatch(0.0))])
            seq += 1
            await asyncio.sleep(0.05)
        await raw.send_multipart([b"", struct.pack(">Q", seq), b"\xc1garbage"])
        await raw.send_multipart([b"", b"\x01"])  # two frames
        await raw.send_multipart([b"", b"bad", good])  # bad seq frame
        await raw.send_multipart([b"", struct.pack(">Q", seq + 1), good])
        await eventually(lambda: _eq(held(index, "r0", router_chain(toks(16))), 1))
        assert sub.stats("r0").decode_errors == 3
        logged = [r for r in caplog.records if "undecodable" in r.getMessage()]
        assert len(logged) == 1  # logged once, not once per bad message (rate-limited)
    finally:
        await sub.close()
        raw.close(0)
        ctx.term()


async def test_bind_mode_one_socket_many_engines():
    port = free_port()
    ep = f"tcp://127.0.0.1:{port}"
    index = MemoryIndex(ttl_s=None)
    sources = [EventSource(f"r{i}", "m", BS, ep, None, f"eng-{i}", bind=True) for i in range(3)]
    sub = EventSubscriber(sources, index)
    await sub.start()
    pubs = [KVEventPublisher(KVEventsConfig(True, "zmq", ep, topic=f"eng-{i}", encoding=enc))
            for i, enc in enumerate(["map", "array", "map"])]
    try:
        for p in pubs:
            await p.start()
        for i, p in enumerate(pubs):
            await sync(p, sub, f"r{i}")
        for i, p in enumerate(pubs):
            await p.publish([stored_chain(toks(16 * (i + 1), i), list(range(10 * i, 10 * i + i + 1)))])
        for i in range(3):
            await eventually(lambda i=i: _eq(held(index, f"r{i}", router_chain(toks(16 * (i + 1), i))), i + 1))
        # nothing leaked across replicas
        assert await held(index, "r1", router_chain(toks(16, 0))) == 0
    finally:
        await sub.close()
        for p in pubs:
            await p.close()


async def test_remove_and_reset_replica():
    pub, sub, index = await start_pair()
    try:
        t = toks(32, 8)
        await pub.publish([stored_chain(t, [1, 2])])
        await eventually(lambda: _eq(held(index, "r0", router_chain(t)), 2))
        await sub.reset_replica("r0", "health")
        assert await held(index, "r0", router_chain(t)) == 0
        await pub.publish([stored_chain(t, [1, 2])])
        await eventually(lambda: _eq(held(index, "r0", router_chain(t)), 2))
        await sub.remove_replica("r0")
        assert await held(index, "r0", router_chain(t)) == 0 and not sub.follows("r0")
        await pub.publish([stored_chain(toks(16, 9), [3])])
        await asyncio.sleep(0.2)
        assert await held(index, "r0", router_chain(toks(16, 9))) == 0
    finally:
        await sub.close()
        await pub.close()


async def test_redis_index_shared(redis_url):
    from router.index.redis import RedisIndex

    index = RedisIndex(redis_url, namespace="kvev")
    await index.start()
    reader = RedisIndex(redis_url, namespace="kvev")  # another router process
    await reader.start()
    pub, sub, _ = await start_pair(index=index)
    try:
        t = toks(64, 10)
        await pub.publish([stored_chain(t, [1, 2, 3, 4])])
        await eventually(lambda: _flushed_eq(index, reader, router_chain(t), 4))
        await pub.publish([BlockRemoved((4,), "GPU"), BlockRemoved((3,), "GPU")])
        await eventually(lambda: _flushed_eq(index, reader, router_chain(t), 2))
        await pub.publish([AllBlocksCleared()])
        await eventually(lambda: _flushed_eq(index, reader, router_chain(t), 0))
    finally:
        await sub.close()
        await pub.close()
        await index.close()
        await reader.close()


async def _flushed_eq(index, reader, hashes, want) -> bool:
    await index.flush()
    return (await reader.lookup("m", hashes)).get("r0", 0) == want


async def test_exact_wins_over_unconfirmed_approximate_records():
    pub, sub, index = await start_pair()
    now = [0.0]
    wrapped = ExactAwareIndex(index, sub, approx_ttl_s=5.0, clock=lambda: now[0])
    try:
        confirmed, never = toks(32, 11), toks(32, 12)
        await wrapped.record("m", router_chain(confirmed), "r0")  # the router's own guesses
        await wrapped.record("m", router_chain(never), "r0")
        await wrapped.record("m", router_chain(never), "r-no-events")
        assert await held(index, "r0", router_chain(never)) == 2  # bridging until events
        await pub.publish([stored_chain(confirmed, [1, 2])])

        async def applied() -> bool:
            return sub.tracker("r0").holds(router_chain(confirmed)[-1])

        await eventually(applied)
        assert await wrapped.sweep() == 0  # not expired yet
        now[0] = 6.0
        assert await wrapped.sweep() == 2
        assert await held(index, "r0", router_chain(confirmed)) == 2
        assert await held(index, "r0", router_chain(never)) == 0
        assert await held(index, "r-no-events", router_chain(never)) == 2  # approximate-only replica
    finally:
        await sub.close()
        await pub.close()


async def test_metrics_exported():
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry()
    pub_ep, rep_ep = ipc_pair()
    pub = KVEventPublisher(KVEventsConfig(True, "zmq", pub_ep, rep_ep, drop_seqs=(3,)))
    await pub.start()
    index = MemoryIndex(ttl_s=None)
    sub = EventSubscriber([EventSource("r0", "m", BS, pub_ep, rep_ep)], index, registry=reg)
    await sub.start()
    try:
        await sync(pub, sub)
        while pub.seq <= 3:
            await pub.publish([])
        await pub.publish([stored_chain(toks(32), [1, 2])])
        await eventually(lambda: _eq(held(index, "r0", router_chain(toks(32))), 2))
        text = generate_latest(reg).decode()
        for name in ("kvrouter_kv_events_received_total", "kvrouter_kv_event_batches_received_total",
                     "kvrouter_kv_event_gaps_total", "kvrouter_kv_event_replays_total",
                     "kvrouter_kv_event_decode_errors_total", "kvrouter_kv_event_lag_seconds_bucket",
                     "kvrouter_kv_event_engine_blocks", "kvrouter_kv_event_last_seq"):
            assert name in text, name
        assert 'kvrouter_kv_event_gaps_total{replica="r0"} 1.0' in text
        assert 'kvrouter_kv_event_engine_blocks{replica="r0"} 2.0' in text
        assert 'kvrouter_kv_events_received_total{replica="r0",type="BlockStored"} 1.0' in text
    finally:
        await sub.close()
        await pub.close()


async def test_eviction_older_than_the_routers_record_is_skipped():
    """The router routed a prefix to r0 after r0 evicted it (the event was still in flight):
    the request will store it again, so that stale removal must not wipe the record."""
    pub, sub, index = await start_pair()
    wall = [1000.0]
    wrapped = ExactAwareIndex(index, sub, approx_ttl_s=5.0, wall=lambda: wall[0])
    try:
        t = toks(32, 13)
        rh = router_chain(t)
        await pub.publish([stored_chain(t, [1, 2])], ts=990.0)
        await eventually(lambda: _eq(held(index, "r0", rh), 2))
        await wrapped.record("m", rh, "r0")  # routing decision at wall time 1000
        await pub.publish([BlockRemoved((2,), "GPU"), BlockRemoved((1,), "GPU")], ts=999.0)  # evicted at 999

        async def applied() -> bool:
            return not sub.tracker("r0").holds(rh[0])

        await eventually(applied)
        assert await held(index, "r0", rh) == 2  # the stale removal was skipped
        # the request's prefill stores the blocks again; a later eviction does remove them
        await pub.publish([stored_chain(t, [1, 2])], ts=1001.0)
        await eventually(lambda: _holds_async(sub, rh))
        await pub.publish([BlockRemoved((2,), "GPU"), BlockRemoved((1,), "GPU")], ts=1002.0)
        await eventually(lambda: _eq(held(index, "r0", rh), 0))
    finally:
        await sub.close()
        await pub.close()


async def _holds_async(sub, hashes) -> bool:
    return all(sub.tracker("r0").holds(h) for h in hashes)
