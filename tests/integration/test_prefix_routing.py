"""Prefix-aware routing end to end: the real router (in process), four ``kvrouter sim``
engines (processes), Redis (real server), the real ``openai`` client.

Covers: the same prefix goes to the same replica (completions and chat with a new turn),
a hot shared prefix spreads within the load bound, two routers on one Redis share
placements, Redis killed mid-test (requests still succeed, affinity returns after it is
back), and ``POST /debug/route``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Any

import aiohttp
import openai
import pytest

from router.config import Config
from router.server import Server
from tests.support.services import RedisServer
from tests.support.sim import sim_factory_module  # noqa: F401 - fixture

MODEL = "llama-3.1-8b"
ADMIN = "admin-key"


@pytest.fixture(scope="module")
def sims(sim_factory_module):  # noqa: F811
    return sim_factory_module(4, time_scale=1, num_blocks=3000, block_size=16, model=MODEL)


def config(sims, **sections: Any) -> Config:
    d: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "policy": {"name": "cache_aware", "options": {}},
        "models": {MODEL: {"tokenizer": "builtin", "block_size": 16}},
        "replicas": [{"id": f"s{i}", "url": s.url, "models": [MODEL]} for i, s in enumerate(sims)],
        "health": {"interval_s": 0.5, "timeout_s": 2.0},
        "scrape": {"interval_s": 0.5},
        "auth": {"admin_key": ADMIN},
        "logging": {"requests": False},
    }
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v} if isinstance(v, dict) else v
    return Config.from_dict(d)


def text(seed: int, n_chars: int) -> str:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "router", "block", "token", "prefix"]
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < n_chars:
        out.append(rng.choice(words) + str(rng.randrange(1000)))
    return " ".join(out)[:n_chars]


def client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def complete(c: openai.AsyncOpenAI, prompt: str, max_tokens: int = 2) -> tuple[str, int]:
    raw = await c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
    usage = raw.parse().usage
    cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage and usage.prompt_tokens_details else 0
    return raw.headers["x-kvrouter-replica"], cached


async def debug_route(server: Server, body: dict[str, Any], key: str = ADMIN) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(server.url + "/debug/route", json=body,
                                                    headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.json()


async def test_same_prefix_same_replica_and_engine_hits(sims) -> None:
    server = await Server(config(sims), seed=0).start()
    try:
        c = client(server)
        homes: dict[int, str] = {}
        for tenant in range(8):
            system = text(tenant, 1200)
            rep, _ = await complete(c, system + " question one")
            homes[tenant] = rep
        assert len(set(homes.values())) >= 3  # cold prompts spread
        for tenant in range(8):
            rep, cached = await complete(c, text(tenant, 1200) + " another question entirely")
            assert rep == homes[tenant]
            assert cached >= 1100  # the engine itself found the prefix in its cache
        async with aiohttp.ClientSession() as s, s.get(server.url + "/metrics") as r:
            metrics = await r.text()
        assert "kvrouter_prefix_measured_hit_tokens_total" in metrics
        assert 'kvrouter_decisions_total{policy="cache_aware",reason="prefix_hit"} 8.0' in metrics
        await c.close()
    finally:
        await server.stop()


async def test_chat_with_same_history_and_new_turn_hits_same_replica(sims) -> None:
    server = await Server(config(sims), seed=0).start()
    try:
        c = client(server)
        msgs: list[dict[str, str]] = [{"role": "system", "content": text(99, 1500)}]
        home = None
        for turn in range(4):
            msgs.append({"role": "user", "content": f"turn {turn}: " + text(1000 + turn, 200)})
            raw = await c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=2)
            rep = raw.headers["x-kvrouter-replica"]
            home = home or rep
            assert rep == home
            resp = raw.parse()
            if turn:
                assert resp.usage.prompt_tokens_details.cached_tokens >= 1500
            msgs.append({"role": "assistant", "content": resp.choices[0].message.content or "ok"})
        await c.close()
    finally:
        await server.stop()


async def test_hot_shared_prefix_spreads_within_the_bound(sims) -> None:
    server = await Server(config(sims), seed=0).start()
    try:
        c = client(server)
        hot = text(7, 2000)
        await complete(c, hot)  # place it
        n = 16
        results = await asyncio.gather(*(complete(c, hot + f" q{i}", max_tokens=48) for i in range(n)))
        per = Counter(rep for rep, _ in results)
        # bound: ceil(1.25 × (in-flight + 1) / 4) + 1 → at most 6 of 16 concurrent on one replica
        assert max(per.values()) <= 6, per
        assert len(per) >= 3, per
        await c.close()
    finally:
        await server.stop()


async def test_debug_route_explains_without_sending(sims) -> None:
    server = await Server(config(sims), seed=0).start()
    try:
        c = client(server)
        prompt = text(31, 800)
        rep, _ = await complete(c, prompt)
        status, d = await debug_route(server, {"model": MODEL, "prompt": prompt + " more"})
        assert status == 200
        assert d["replica"] == rep and d["reason"] == "prefix_hit" and d["policy"] == "cache_aware"
        assert d["matched_blocks"] == 800 // 16 and d["blocks"] == len(prompt + " more") // 16
        assert {r["id"] for r in d["replicas"]} == {"s0", "s1", "s2", "s3"}
        assert all(isinstance(r["score"], float) for r in d["replicas"])
        status, d = await debug_route(server, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and d["path"] == "/v1/chat/completions" and d["reason"] == "cold"
        status, d = await debug_route(server, {"model": MODEL, "prompt": "x"}, key="wrong")
        assert status == 401 and d["error"]["code"] == "invalid_api_key"
        status, d = await debug_route(server, {"model": "nope", "prompt": "x"})
        assert status == 404 and d["error"]["code"] == "model_not_found"
        async with aiohttp.ClientSession() as s, s.post(
                server.url + "/debug/route", data=b"{", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
        await c.close()
    finally:
        await server.stop()


async def test_two_routers_on_one_redis_share_placement(sims, redis_url) -> None:
    idx = {"backend": "redis", "url": redis_url, "namespace": "shared"}
    a = await Server(config(sims, index=idx), seed=1).start()
    b = await Server(config(sims, index=idx), seed=2).start()
    try:
        ca, cb = client(a), client(b)
        for tenant in range(4):
            prompt = text(500 + tenant, 1000)
            rep_a, _ = await complete(ca, prompt + " via a")
            await a.state.prefix.index.flush()
            rep_b, cached = await complete(cb, prompt + " via b")
            assert rep_b == rep_a and cached >= 960
        await ca.close()
        await cb.close()
    finally:
        await a.stop()
        await b.stop()


async def test_redis_killed_mid_test_requests_succeed_then_affinity_returns(sims) -> None:
    redis = RedisServer().start()
    server = await Server(config(sims, index={"backend": "redis", "url": redis.url}), seed=0).start()
    try:
        c = client(server)
        prompt = text(77, 1000)
        home, _ = await complete(c, prompt)
        await server.state.prefix.index.flush()
        assert (await complete(c, prompt + " again"))[0] == home
        redis.stop(kill=True)
        for i in range(8):  # no request fails because Redis is down
            await complete(c, text(200 + i, 300))
        async with aiohttp.ClientSession() as s, s.get(server.url + "/metrics") as r:
            assert "kvrouter_index_up 0.0" in await r.text()
        redis.start()
        deadline = time.monotonic() + 20
        reason = ""
        while time.monotonic() < deadline:
            await complete(c, prompt)
            await server.state.prefix.index.flush()
            status, d = await debug_route(server, {"model": MODEL, "prompt": prompt + " back"})
            reason = d["reason"]
            if reason == "prefix_hit":
                break
            await asyncio.sleep(0.3)
        assert reason == "prefix_hit"
        assert (await complete(c, prompt + " back"))[0] == d["replica"]
        async with aiohttp.ClientSession() as s, s.get(server.url + "/metrics") as r:
            assert "kvrouter_index_up 1.0" in await r.text()
        await c.close()
    finally:
        await server.stop()
        redis.stop()


async def test_index_capacity_follows_the_engines_scraped_kv_blocks(sims) -> None:
    server = await Server(config(sims), seed=0).start()
    try:
        index = server.state.prefix.index.index  # MemoryIndex -> PrefixIndex
        server.state.prefix.capacity_interval_s = 0.1
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and index.capacity("s0") != 3000:
            await asyncio.sleep(0.1)
        # the sims run with --num-blocks 3000, published in vllm:cache_config_info
        assert [index.capacity(f"s{i}") for i in range(4)] == [3000] * 4
    finally:
        await server.stop()
