"""Exact tracking inside the router: replicas with ``kv_events`` in the config, the real router
(in process, cache_aware), ``kvrouter sim`` engines publishing events, the real ``openai``
client. The index learns blocks the router never routed (traffic sent straight to an
engine), forgets blocks the engine evicted although the router recorded them itself, and an
engine restart clears that replica."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
import pytest

from router.config import Config
from router.core.bytetok import encode
from router.core.hashing import block_hashes, seed_hash
from router.server import Server
from tests.support.kv_fleet import kv_event_fleet
from tests.support.sim import SimHandle

MODEL = "sim-model"
ADMIN = "admin-key"
BS = 16


def prompt(i: int, n: int = 320) -> str:
    words = f"tenant {i} asks about subject {i * 5 % 11} in some detail "
    return (words * (n // len(words) + 1))[:n]


@pytest.fixture
def fleet():
    yield from kv_event_fleet(MODEL, BS, 64, "kvr-rt-ev-")


def config(sims: list[SimHandle], kv: list[dict[str, Any]]) -> Config:
    return Config.from_dict({
        "listen": {"host": "127.0.0.1", "port": 0},
        "policy": {"name": "cache_aware", "options": {}},
        "models": {MODEL: {"tokenizer": "builtin", "block_size": BS}},
        "index": {"backend": "memory"},
        "replicas": [{"id": f"s{i}", "url": s.url, "models": [MODEL], "kv_events": kv[i]}
                     for i, s in enumerate(sims)],
        "health": {"interval_s": 0.5, "timeout_s": 2.0},
        "auth": {"admin_key": ADMIN},
        "logging": {"requests": False},
    })


async def matched(server: Server, text: str) -> dict[str, int]:
    async with aiohttp.ClientSession() as s, s.post(
            server.url + "/debug/route", json={"model": MODEL, "prompt": text},
            headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        assert r.status == 200
        body = await r.json()
    return {x["id"]: x["matched_blocks"] for x in body["replicas"]}


async def wait_for(pred, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not await pred():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_exact_tracking_in_the_router(fleet):
    sims, kv = fleet
    server = await Server(config(sims, kv), seed=0).start()
    http = aiohttp.ClientSession()
    try:
        index = server.state.prefix.index
        sub = server.state.prefix.events
        assert sub is not None and sorted(sub.replicas()) == ["s0", "s1"]
        full = len(encode(prompt(0))) // BS

        # 1. routed through the router: the served replica holds the whole prompt (events)
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
        raw = await c.completions.with_raw_response.create(model=MODEL, prompt=prompt(0), max_tokens=2)
        served = raw.headers["x-kvrouter-replica"]
        other = "s1" if served == "s0" else "s0"
        hashes = block_hashes(encode(prompt(0)), BS, seed_hash(MODEL))
        await wait_for(lambda: _holds(sub, served, hashes))
        assert (await matched(server, prompt(0)))[served] == full

        # 2. traffic the router never saw (sent straight to the other engine) is indexed too
        direct = prompt(1)
        r = await http.post(sims[int(other[1])].url + "/v1/completions",
                            json={"model": MODEL, "prompt": direct, "max_tokens": 2})
        assert r.status == 200
        await wait_for(lambda: _eq(matched(server, direct), other, len(encode(direct)) // BS))

        # 3. the engine evicts what the router itself recorded: the event wins
        for n in range(2, 10):
            r = await http.post(sims[int(served[1])].url + "/v1/completions",
                                json={"model": MODEL, "prompt": prompt(n), "max_tokens": 2})
            assert r.status == 200
        engine_blocks = set(await (await http.get(sims[int(served[1])].url + "/debug/kv_blocks")).json())
        assert not set(hashes) <= engine_blocks  # prompt 0 was (at least partly) evicted
        await wait_for(lambda: _eq(matched(server, prompt(0)), served, _prefix_len(hashes, engine_blocks)))

        # 4. engine restart: the replica's entries are cleared without any new request
        assert index.inner.index.size(other) > 0
        await asyncio.to_thread(sims[int(other[1])].restart)

        async def cleared() -> bool:
            return index.inner.index.size(other) == 0

        await wait_for(cleared, timeout=20)
        assert (await matched(server, direct)).get(other, 0) == 0
    finally:
        await http.close()
        await server.stop()


def _prefix_len(hashes: list[int], held: set[int]) -> int:
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


async def _holds(sub, replica: str, hashes: list[int]) -> bool:
    t = sub.tracker(replica)
    return all(t.holds(h) for h in hashes)


async def _eq(coro, replica: str, want: int) -> bool:
    return (await coro).get(replica, 0) == want
