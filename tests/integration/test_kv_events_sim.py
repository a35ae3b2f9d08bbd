"""End to end with simulated engines publishing KV events (``kvrouter sim --kv-events-config``):
the index holds exactly each engine's blocks (compared with ``GET /debug/kv_blocks``), also
after evictions; ``/reset_prefix_cache`` (AllBlocksCleared) and an engine restart clear the
replica; a forced sequence gap is replayed and the index converges; the tokens of
``/tokenize`` and of the events agree."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from router.core.hashing import block_hashes, seed_hash
from router.events import EventSource, EventSubscriber
from router.index.memory import MemoryIndex
from tests.support.sim import SimHandle, stop_sims

BS = 16
MODEL = "sim-model"


def kv_config(encoding: str, **extra) -> tuple[str, str, str]:
    d = Path(tempfile.mkdtemp(prefix="kvr-sim-ev-"))
    pub, rep = f"ipc://{d}/pub", f"ipc://{d}/replay"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
           "replay_endpoint": rep, "topic": "", "encoding": encoding, **extra}
    return json.dumps(cfg), pub, rep


def prompt(i: int, n: int = 300) -> str:
    words = f"request {i} about topic {i * 7 % 13} with details "
    return (words * (n // len(words) + 1))[:n]


class Fleet:
    def __init__(self, specs: list[dict]):
        self.sims: list[SimHandle] = []
        self.sources: list[EventSource] = []
        for i, spec in enumerate(specs):
            cfg, pub, rep = kv_config(spec.pop("encoding", "map"), **spec.pop("kv_extra", {}))
            flags = {"model": MODEL, "block_size": BS, "num_blocks": 64, "max_num_seqs": 4,
                     "kv_events_config": cfg, **spec}
            self.sims.append(SimHandle(**flags))
            self.sources.append(EventSource(f"r{i}", MODEL, BS, pub, rep))
        self.index = MemoryIndex(ttl_s=None)
        self.sub = EventSubscriber(self.sources, self.index, replay_timeout_s=5.0)
        self.http = httpx.AsyncClient(timeout=30.0)

    async def start(self) -> Fleet:
        for s in self.sims:
            s.launch()
        for s in self.sims:
            s.wait_ready()
        await self.sub.start()
        await asyncio.sleep(0.3)  # let the SUB sockets connect (slow joiner)
        return self

    async def close(self) -> None:
        await self.sub.close()
        await self.http.aclose()
        stop_sims(self.sims)

    async def complete(self, i: int, text: str, max_tokens: int = 4) -> dict:
        r = await self.http.post(self.sims[i].url + "/v1/completions",
                                 json={"model": MODEL, "prompt": text, "max_tokens": max_tokens})
        r.raise_for_status()
        return r.json()

    async def engine_blocks(self, i: int) -> set[int]:
        r = await self.http.get(self.sims[i].url + "/debug/kv_blocks")
        return set(r.json())

    async def exact(self, i: int) -> bool:
        """The index holds exactly the engine's cached blocks for replica ``i``."""
        rid = f"r{i}"
        engine = await self.engine_blocks(i)
        tracker = self.sub.tracker(rid)
        want: set[int] = set()
        for eh in engine:
            rh = tracker.router_hashes(eh)
            if rh is None:
                return False
            want.update(rh)
        if self.index.index.size(rid) != len(want):
            return False
        for h in want:
            if rid not in await self.index.lookup(MODEL, [h]):
                return False
        return True

    async def converge(self, i: int, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not await self.exact(i):
            if time.monotonic() > deadline:
                st = self.sub.stats(f"r{i}")
                raise AssertionError(f"index of r{i} did not converge: {st}, "
                                     f"index={self.index.index.size(f'r{i}')}, "
                                     f"engine={len(await self.engine_blocks(i))}")
            await asyncio.sleep(0.05)


@pytest.fixture
async def fleet(request):
    f = await Fleet(request.param).start()
    try:
        yield f
    finally:
        await f.close()


BOTH = [[{"encoding": "map"}, {"encoding": "array", "prefix_hash": "vllm"}]]


@pytest.mark.parametrize("fleet", BOTH, indirect=True)
async def test_index_equals_engine_blocks_through_evictions(fleet):
    for i in range(2):
        await fleet.complete(i, prompt(0))
    for i in range(2):
        await fleet.converge(i)
        assert fleet.index.index.size(f"r{i}") > 0
    # /tokenize and the events agree: the router's own hashes of the engine's tokens are indexed
    for i in range(2):
        toks = (await fleet.http.post(fleet.sims[i].url + "/tokenize",
                                      json={"model": MODEL, "prompt": prompt(0)})).json()["tokens"]
        hashes = block_hashes(toks, BS, seed_hash(MODEL))
        assert (await fleet.index.lookup(MODEL, hashes)).get(f"r{i}") == len(hashes)
    # cache_salt reaches the events (extra_keys of the first block, map encoding): the
    # salted chain is indexed under the router's salted hashes
    r = await fleet.http.post(fleet.sims[0].url + "/v1/completions",
                              json={"model": MODEL, "prompt": prompt(0), "max_tokens": 2, "cache_salt": "s1"})
    assert r.status_code == 200
    salted = block_hashes(toks, BS, seed_hash(MODEL, None, "s1"))
    deadline = time.monotonic() + 10
    while (await fleet.index.lookup(MODEL, salted)).get("r0") != len(salted):
        assert time.monotonic() < deadline, "salted chain not indexed"
        await asyncio.sleep(0.05)
    await fleet.converge(0)
    # 64 blocks per engine: 12 prompts of ~19 blocks evict most of the first ones
    for n in range(1, 13):
        for i in range(2):
            await fleet.complete(i, prompt(n))
    for i in range(2):
        await fleet.converge(i)
        st = fleet.sub.stats(f"r{i}")
        assert st.decode_errors == 0 and st.gaps == 0
        assert fleet.sub.tracker(f"r{i}").stats.removed_blocks > 0  # evictions were followed
    toks0 = (await fleet.http.post(fleet.sims[0].url + "/tokenize",
                                   json={"model": MODEL, "prompt": prompt(0)})).json()["tokens"]
    assert (await fleet.index.lookup(MODEL, block_hashes(toks0, BS, seed_hash(MODEL)))).get("r0", 0) == 0


@pytest.mark.parametrize("fleet", BOTH, indirect=True)
async def test_reset_prefix_cache_and_restart_clear_the_replica(fleet):
    for i in range(2):
        await fleet.complete(i, prompt(1))
        await fleet.converge(i)
    # AllBlocksCleared
    r = await fleet.http.post(fleet.sims[0].url + "/reset_prefix_cache")
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    while fleet.index.index.size("r0") != 0:
        assert time.monotonic() < deadline, "AllBlocksCleared not applied"
        await asyncio.sleep(0.05)
    assert fleet.index.index.size("r1") > 0  # the other replica is untouched
    # engine restart (empty cache, sequence numbers from 0): r1's old entries must go
    old = set(fleet.index.index._lru["r1"])
    await asyncio.to_thread(fleet.sims[1].restart)
    await fleet.complete(1, prompt(2))
    await fleet.converge(1)
    assert not old & set(fleet.index.index._lru.get("r1", {})), "stale entries survived the restart"
    assert fleet.sub.stats("r1").clears >= 2


GAP = [[{"encoding": "map", "kv_extra": {"drop_seqs": [2, 3, 7]}},
        {"encoding": "array", "prefix_hash": "vllm", "kv_extra": {"drop_seqs": [1, 4]}}]]


@pytest.mark.parametrize("fleet", GAP, indirect=True)
async def test_forced_seq_gap_triggers_replay_and_converges(fleet):
    for n in range(6):
        for i in range(2):
            await fleet.complete(i, prompt(n, 200))
    for i in range(2):
        await fleet.converge(i)
        st = fleet.sub.stats(f"r{i}")
        assert st.gaps >= 1 and st.replays >= 1, st
        assert st.replay_failures == 0, st
