"""Exact mode makes the index equal the engines' caches — through the real router.

The real router (in process, ``cache_aware``) with its real index (memory, or Redis started
by the fixture), two ``kvrouter sim`` engines of 64 blocks publishing KV events, the real
``openai`` client. The router records its own placements *and* follows the events, with the
engines' capacity configured (``capacity_blocks: 64``) as the scraper would set it: the
index's per-replica bound must not push out blocks the engine still holds. After traffic
that fills and evicts both caches, each replica's blocks in the index equal the engine's
``GET /debug/kv_blocks`` within a bounded wait, and ``/debug/route`` matches, for every
prompt sent, exactly the prefix the engine holds.

Membership: a replica removed from the pool (``DELETE /admin/replicas/{id}``) is no longer
rebuilt by its events; added again (``POST /admin/replicas``) it is followed again; a config
reload that drops a replica's ``kv_events`` stops following it, one that adds them (to a
router started without any) starts following.
"""

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
from router.lifecycle import apply_config
from router.server import Server
from tests.support.kv_fleet import kv_event_fleet
from tests.support.sim import SimHandle

MODEL = "sim-model"
ADMIN = "admin-key"
BS = 16
ENGINE_BLOCKS = 64


def prompt(i: int, n: int = 330) -> str:
    words = f"customer {i} wants a report on topic {i * 7 % 13} with figures "
    return (words * (n // len(words) + 1))[:n]


@pytest.fixture
def fleet():
    yield from kv_event_fleet(MODEL, BS, ENGINE_BLOCKS, "kvr-eq-ev-")


def config(sims: list[SimHandle], kv: list[dict[str, Any] | None], index: dict[str, Any]) -> Config:
    return Config.from_dict({
        "listen": {"host": "127.0.0.1", "port": 0},
        "policy": {"name": "cache_aware", "options": {}},
        "models": {MODEL: {"tokenizer": "builtin", "block_size": BS}},
        "index": {**index, "approx_ttl_s": 1.0},
        "replicas": [{"id": f"s{i}", "url": s.url, "models": [MODEL], "capacity_blocks": ENGINE_BLOCKS,
                      "kv_events": kv[i]} for i, s in enumerate(sims)],
        "health": {"interval_s": 0.5, "timeout_s": 5.0, "failure_threshold": 5},
        "auth": {"admin_key": ADMIN},
        "logging": {"requests": False},
    })


async def index_blocks(server: Server, replica: str) -> set[int]:
    """Every block the index holds for ``replica`` (live entries only)."""
    inner = server.state.prefix.index.inner
    if hasattr(inner, "index"):  # MemoryIndex → PrefixIndex
        return set(inner.index._lru.get(replica, {}))
    await inner.flush()
    client = inner.client
    meta_key, prefix = inner._keys(MODEL)
    meta = await client.hgetall(meta_key[0])
    g, w = meta.get(f"g:{replica}".encode()), meta.get(f"w:{replica}".encode())
    if g is None or w is None:
        return set()
    floor = int(g) - int(w)
    out: set[int] = set()
    async for key in client.scan_iter(match=prefix + replica.encode() + b":*"):
        for h, gen in (await client.hgetall(key)).items():
            if int(gen) > floor:
                out.add(int.from_bytes(h, "little"))
    return out


async def engine_blocks(http: aiohttp.ClientSession, sim: SimHandle) -> set[int]:
    async with http.get(sim.url + "/debug/kv_blocks") as r:
        assert r.status == 200
        return set(await r.json())


async def matched(http: aiohttp.ClientSession, server: Server, text: str) -> dict[str, int]:
    async with http.post(server.url + "/debug/route", json={"model": MODEL, "prompt": text},
                         headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        assert r.status == 200
        body = await r.json()
    return {x["id"]: x["matched_blocks"] for x in body["replicas"]}


def held_prefix(hashes: list[int], held: set[int]) -> int:
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


async def converge(check, timeout: float = 20.0) -> Any:
    """Poll ``check()`` (→ (ok, detail)) until ok; fail with the last detail."""
    deadline = time.monotonic() + timeout
    while True:
        ok, detail = await check()
        if ok:
            return detail
        assert time.monotonic() < deadline, f"index did not converge: {detail}"
        await asyncio.sleep(0.1)


async def equal_to_engines(server: Server, http: aiohttp.ClientSession, sims: list[SimHandle],
                           replicas: list[str]) -> tuple[bool, Any]:
    detail = {}
    for rid in replicas:
        eng = await engine_blocks(http, sims[int(rid[1])])
        idx = await index_blocks(server, rid)
        detail[rid] = {"engine": len(eng), "index": len(idx), "missing": len(eng - idx),
                       "extra": len(idx - eng)}
    return all(d["missing"] == 0 and d["extra"] == 0 for d in detail.values()), detail


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_index_equals_engine_caches_through_the_router(fleet, backend, request):
    sims, kv = fleet
    index = {"backend": "memory"}
    if backend == "redis":
        # the session's Redis (fixture; its own port), a namespace of our own
        index = {"backend": "redis", "url": request.getfixturevalue("redis_server").url,
                 "namespace": f"eq-{time.monotonic_ns()}"}
    server = await Server(config(sims, kv, index), seed=0).start()
    http = aiohttp.ClientSession()
    try:
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
        texts = [prompt(i) for i in range(10)] + [prompt(i) for i in (0, 3, 3, 7, 8, 9, 9)]
        for t in texts:  # ~20 blocks each: both 64-block caches fill and evict
            await c.completions.create(model=MODEL, prompt=t, max_tokens=24)
        detail = await converge(lambda: equal_to_engines(server, http, sims, ["s0", "s1"]))
        assert all(d["engine"] > 0 for d in detail.values()), detail
        # evictions happened: the engines together hold fewer blocks than the traffic made
        distinct = {h for t in texts for h in block_hashes(encode(t), BS, seed_hash(MODEL))}
        assert sum(d["engine"] for d in detail.values()) < len(distinct), detail
        # and routing sees it: for every prompt, the prefix each engine holds, no more, no less
        engines = {f"s{i}": await engine_blocks(http, s) for i, s in enumerate(sims)}
        for t in dict.fromkeys(texts):
            hashes = block_hashes(encode(t), BS, seed_hash(MODEL))
            got = await matched(http, server, t)
            for rid, held in engines.items():
                assert got.get(rid, 0) == held_prefix(hashes, held), (t[:30], rid, got)
    finally:
        await http.close()
        await server.stop()


async def test_pool_removal_and_reload_follow_membership(fleet):
    sims, kv = fleet
    cfg = config(sims, kv, {"backend": "memory"})
    server = await Server(cfg, seed=0).start()
    http = aiohttp.ClientSession()
    st = server.state
    try:
        sub = st.prefix.events
        assert sub is not None and sub.follows("s1")
        r = await http.post(sims[1].url + "/v1/completions", json={"model": MODEL, "prompt": prompt(1), "max_tokens": 2})
        assert r.status == 200
        await converge(lambda: equal_to_engines(server, http, sims, ["s1"]))
        assert await index_blocks(server, "s1")

        # 1. removed from the pool: cleared, and its events no longer rebuild it
        async with http.delete(server.url + "/admin/replicas/s1", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert r.status == 200

        async def gone() -> tuple[bool, Any]:
            n = len(await index_blocks(server, "s1"))
            return (not sub.follows("s1") and n == 0), n

        await converge(gone)
        r = await http.post(sims[1].url + "/v1/completions", json={"model": MODEL, "prompt": prompt(2), "max_tokens": 2})
        assert r.status == 200
        stored = set(block_hashes(encode(prompt(2)), BS, seed_hash(MODEL)))
        assert stored <= await engine_blocks(http, sims[1])
        await asyncio.sleep(1.0)  # events of that request arrive within ms when followed
        assert await index_blocks(server, "s1") == set()
        assert (await matched(http, server, prompt(2))).get("s1", 0) == 0

        # 2. added again (admin API, same kv_events): followed again, rebuilt from the replay buffer
        body = {"id": "s1", "url": sims[1].url, "models": [MODEL], "capacity_blocks": ENGINE_BLOCKS,
                "kv_events": kv[1]}
        async with http.post(server.url + "/admin/replicas", json=body,
                             headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert r.status == 201
        assert sub.follows("s1")
        await converge(lambda: equal_to_engines(server, http, sims, ["s1"]))
        assert stored <= await index_blocks(server, "s1")

        # 3. a reload dropping s0's kv_events: no longer followed, its entries cleared
        r = await http.post(sims[0].url + "/v1/completions", json={"model": MODEL, "prompt": prompt(3), "max_tokens": 2})
        assert r.status == 200
        await converge(lambda: equal_to_engines(server, http, sims, ["s0"]))
        assert await index_blocks(server, "s0")
        no_s0 = config(sims, [None, kv[1]], {"backend": "memory"})
        await apply_config(st, no_s0)
        assert not sub.follows("s0") and sub.follows("s1")
        assert await index_blocks(server, "s0") == set()
        # s0 is approximate now: the router's own record counts again, with the engine's bound
        await st.prefix.index.record(MODEL, [1, 2, 3], "s0")
        assert st.prefix.index.inner.index.capacity("s0") == ENGINE_BLOCKS
        assert st.prefix.index.inner.index.capacity("s1") > ENGINE_BLOCKS
    finally:
        await http.close()
        await server.stop()


async def test_reload_adds_event_sources_to_a_router_started_without_any(fleet):
    sims, kv = fleet
    cfg = config(sims, [None, None], {"backend": "memory"})
    server = await Server(cfg, seed=0).start()
    http = aiohttp.ClientSession()
    st = server.state
    try:
        assert st.prefix.events is None
        r = await http.post(sims[0].url + "/v1/completions", json={"model": MODEL, "prompt": prompt(4), "max_tokens": 2})
        assert r.status == 200
        await apply_config(st, config(sims, [kv[0], None], {"backend": "memory"}))
        sub = st.prefix.events
        assert sub is not None and sub.follows("s0") and not sub.follows("s1")
        # traffic the router never routed, stored before the reload: learnt from the replay buffer
        await converge(lambda: equal_to_engines(server, http, sims, ["s0"]))
        assert (await matched(http, server, prompt(4)))["s0"] == len(encode(prompt(4))) // BS
    finally:
        await http.close()
        await server.stop()
