"""A replay of a long engine buffer arrives whole: a subscriber that starts after the engine
has published thousands of batches rebuilds from all of them (one ``ok`` replay, no gap,
no clear but the start one), and the live stream that follows needs no repair.

Before the fix, the replay's ZMQ pipes (the engine's ROUTER and the subscriber's DEALER,
1,000 messages each by default) silently dropped everything past ~2,000 batches, end
marker included: the replay failed or came back holed, an idle engine left the index
behind for good, and live traffic then went through gap → replay → resync/gap clears
mid-run. vLLM's replay socket keeps ZMQ's default (it drops the tail of a long reply), so
the subscriber also asks again from where a cut-short replay stopped.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import pytest

from backends.kv_events import BlockRemoved, BlockStored
from backends.sim.kv_publisher import KVEventPublisher, KVEventsConfig
from router.core.hashing import block_hashes, seed_hash
from router.events import EventSource, EventSubscriber
from router.index.memory import MemoryIndex

BS = 16
BATCHES = 6000  # well past the two default 1,000-message high-water marks


def _counter(sub: EventSubscriber, name: str) -> dict[tuple[str, ...], float]:
    """Samples of one subscriber metric, by label values other than the replica."""
    out: dict[tuple[str, ...], float] = {}
    for m in sub.metrics.registry.collect():
        for s in m.samples:
            if s.name == name:
                key = tuple(v for k, v in sorted(s.labels.items()) if k != "replica")
                out[key] = out.get(key, 0.0) + s.value
    return out


def _chain(i: int) -> tuple[list[int], list[int]]:
    """Tokens and engine hashes of the i-th 4-block chain (distinct per i)."""
    tokens = [(i * 131 + j * 7) % 50_000 for j in range(4 * BS)]
    return tokens, [10_000_000 + 4 * i + k for k in range(4)]


async def _engine_with_history(**cfg: int) -> tuple[KVEventPublisher, str, str]:
    """A publisher that has sent ``BATCHES`` batches before any subscriber: each stores a
    chain and evicts the previous one, so the final state is known (the last chain)."""
    d = Path(tempfile.mkdtemp(prefix="kvr-ev-long-"))
    pub_ep, rep_ep = f"ipc://{d}/pub", f"ipc://{d}/replay"
    pub = KVEventPublisher(KVEventsConfig(True, "zmq", pub_ep, rep_ep, **cfg))
    await pub.start()
    for i in range(BATCHES):
        tokens, eng = _chain(i)
        events: list = [BlockStored(tuple(eng), None, tuple(tokens), BS, None, "GPU")]
        if i:
            events.append(BlockRemoved(tuple(_chain(i - 1)[1]), "GPU"))
        await pub.publish(events)
    return pub, pub_ep, rep_ep


async def _rebuilt(sub: EventSubscriber, index: MemoryIndex, upto: int) -> None:
    """Waits (no live message: the engine is idle) until the replay applied batch ``upto``;
    then the index holds exactly the last chain."""
    deadline = time.monotonic() + 30
    while sub.stats("r0").last_seq != upto:
        assert time.monotonic() < deadline, f"replay stopped at {sub.stats('r0').last_seq}"
        await asyncio.sleep(0.05)
    await sub.idle(30)
    assert _counter(sub, "kvrouter_kv_event_clears_total") == {("start",): 1.0}
    assert sub.stats("r0").batches == upto + 1
    want = block_hashes(_chain(upto)[0], BS, seed_hash("m"))
    assert (await index.lookup("m", want)).get("r0", 0) == 4
    assert len(sub.tracker("r0")) == 4


@pytest.mark.parametrize("replay_timeout_s", [0.5, 20.0])
async def test_replay_cut_short_by_the_engine_is_asked_again(replay_timeout_s: float) -> None:
    """vLLM's replay ROUTER keeps ZMQ's 1,000-message high-water mark and drops the rest of
    a longer reply: the subscriber asks again from where it stopped until it has it all
    (the simulator's ``replay_limit`` cuts every reply after 1,500 batches, no end marker).
    With a long ``replay_timeout_s`` (the wait for an engine's first answer) a cut round
    still ends after ``REPLAY_GAP_S`` of silence: three rounds of a 20 s timeout would take
    60 s, past ``_rebuilt``'s 30 s."""
    pub, pub_ep, rep_ep = await _engine_with_history(replay_limit=1500)
    index = MemoryIndex(ttl_s=None)
    sub = EventSubscriber([EventSource("r0", "m", BS, pub_ep, rep_ep)], index, replay_timeout_s=replay_timeout_s)
    await sub.start()
    try:
        await _rebuilt(sub, index, BATCHES - 1)
        # three cut-short rounds (1,500 batches each, then silence), the fourth ends
        assert _counter(sub, "kvrouter_kv_event_replays_total") == {("partial",): 3.0, ("ok",): 1.0}
    finally:
        await sub.close()
        await pub.close()


async def test_long_replay_buffer_arrives_whole_and_live_needs_no_repair() -> None:
    pub, pub_ep, rep_ep = await _engine_with_history()
    index = MemoryIndex(ttl_s=None)
    sub = EventSubscriber([EventSource("r0", "m", BS, pub_ep, rep_ep)], index, replay_timeout_s=5.0)
    await sub.start()
    try:
        await _rebuilt(sub, index, BATCHES - 1)
        assert _counter(sub, "kvrouter_kv_event_replays_total") == {("ok",): 1.0}
        # live traffic after the replay: applied in order, nothing to repair
        for i in range(BATCHES, BATCHES + 200):
            tokens, eng = _chain(i)
            await pub.publish([BlockStored(tuple(eng), None, tuple(tokens), BS, None, "GPU"),
                               BlockRemoved(tuple(_chain(i - 1)[1]), "GPU")])
        deadline = time.monotonic() + 30
        while sub.stats("r0").last_seq != BATCHES + 199:
            assert time.monotonic() < deadline, f"live stream stopped at {sub.stats('r0').last_seq}"
            await asyncio.sleep(0.05)
        await sub.idle(30)
        assert _counter(sub, "kvrouter_kv_event_gaps_total").get((), 0.0) == 0.0
        assert _counter(sub, "kvrouter_kv_event_replays_total") == {("ok",): 1.0}
        assert _counter(sub, "kvrouter_kv_event_clears_total") == {("start",): 1.0}
        assert len(sub.tracker("r0")) == 4
    finally:
        await sub.close()
        await pub.close()
