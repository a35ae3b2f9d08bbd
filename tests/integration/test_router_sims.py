"""The router in front of three real ``kvrouter sim`` engines, over real sockets: each
simple policy routes as documented; a replica killed mid-run is ejected and no request is
lost; a client that goes away mid-stream leaves the router's in-flight count and the
engine's ``vllm:num_requests_running`` back at 0."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import orjson
import pytest

from backends.engines import parse_load
from router.config import Config
from router.server import Server

MODEL = "llama-3.1-8b"


def cfg(sims: list[Any], name: str = "round_robin", **sections: Any) -> Config:
    d: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "policy": {"name": name},
        "replicas": [{"id": f"s{i}", "url": s.url, "models": [MODEL]} for i, s in enumerate(sims)],
        # generous health timeout: a check timing out on a loaded machine ejects a healthy sim
        "health": {"interval_s": 0.3, "timeout_s": 10.0, "failure_threshold": 1, "success_threshold": 1},
        "scrape": {"interval_s": 0.3},
        "upstream": {"retry_backoff_s": 0.01, "max_retries": 3},
        "logging": {"requests": False},
    }
    d.update(sections)
    return Config.from_dict(d)


@contextlib.asynccontextmanager
async def router(sims: list[Any], name: str = "round_robin", **sections: Any):
    server = await Server(cfg(sims, name, **sections), seed=1).start()
    try:
        yield server
    finally:
        await server.stop()


async def complete(s: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None,
                   **body: Any) -> tuple[int, str, dict[str, Any]]:
    payload = {"model": MODEL, "prompt": "Hello there", "max_tokens": 2, **body}
    async with s.post(url + "/v1/completions", json=payload, headers=headers or {}) as r:
        return r.status, r.headers.get("x-kvrouter-replica", ""), orjson.loads(await r.read())


async def engine_running(s: aiohttp.ClientSession, url: str) -> float:
    async with s.get(url + "/metrics") as r:
        return parse_load(await r.text()).running


async def until(cond, timeout: float = 10.0) -> float:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while True:
        v = cond()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return loop.time() - t0
        if loop.time() - t0 > timeout:
            pytest.fail("condition not reached in time")
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def sims3(sim_factory_module):
    return sim_factory_module(3, time_scale=0.05, model=MODEL)


async def test_round_robin_in_pool_order(sims3):
    async with router(sims3) as r, aiohttp.ClientSession() as s:
        got = [(await complete(s, r.url))[1] for _ in range(6)]
    assert got == ["s0", "s1", "s2", "s0", "s1", "s2"]


async def test_random_uses_every_replica(sims3):
    async with router(sims3, "random") as r, aiohttp.ClientSession() as s:
        got = [(await complete(s, r.url))[1] for _ in range(30)]
    assert set(got) == {"s0", "s1", "s2"}


async def _open_stream(s: aiohttp.ClientSession, url: str, **body: Any) -> aiohttp.ClientResponse:
    """A long stream, returned once its first event has arrived (so it is in flight)."""
    resp = await s.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Tell me a long story",
                                                       "max_tokens": 5000, "stream": True, **body})
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    return resp


async def test_least_loaded_spreads_concurrent_streams(sims3):
    async with router(sims3, "least_loaded") as r, aiohttp.ClientSession() as s:
        streams = [await _open_stream(s, r.url) for _ in range(3)]
        try:
            assert sorted(x.headers["x-kvrouter-replica"] for x in streams) == ["s0", "s1", "s2"]
            states = r.state.pool.all_states()
            assert [st.in_flight for st in states] == [1, 1, 1]
        finally:
            for x in streams:
                x.close()
        await until(lambda: all(st.in_flight == 0 for st in r.state.pool.all_states()))


async def test_power_of_two_never_picks_the_unique_most_loaded(sims3):
    async with router(sims3, "power_of_two") as r, aiohttp.ClientSession() as s:
        states = {st.id: st for st in r.state.pool.all_states()}
        streams = []
        try:
            for _ in range(7):
                before = {k: v.in_flight for k, v in states.items()}
                x = await _open_stream(s, r.url)
                streams.append(x)
                picked = x.headers["x-kvrouter-replica"]
                top = max(before.values())
                assert not (before[picked] == top and list(before.values()).count(top) == 1), (before, picked)
        finally:
            for x in streams:
                x.close()


async def test_session_sticks_by_header_and_by_user(sims3):
    async with router(sims3, "session") as r, aiohttp.ClientSession() as s:
        homes = {}
        for key in ("alice", "bob", "carol", "dave", "erin", "frank"):
            got = {(await complete(s, r.url, headers={"x-session-id": key}))[1] for _ in range(3)}
            assert len(got) == 1
            homes[key] = got.pop()
        assert len(set(homes.values())) >= 2  # sessions spread over the fleet
        by_user = {(await complete(s, r.url, user="alice"))[1] for _ in range(3)}
        assert len(by_user) == 1


async def test_killed_replica_is_ejected_and_no_request_is_lost(sim_factory):
    sims = sim_factory(3, time_scale=0.05, model=MODEL)
    async with router(sims, health={"interval_s": 5.0, "timeout_s": 10.0, "failure_threshold": 2,
                                    "success_threshold": 1}) as r, aiohttp.ClientSession() as s:
        stream = await _open_stream(s, r.url)  # lands on s0 (round robin), then s0 dies
        assert stream.headers["x-kvrouter-replica"] == "s0"
        statuses: list[int] = []

        async def worker() -> None:
            for _ in range(12):  # sequential requests that span the kill
                st, _, body = await complete(s, r.url, max_tokens=48)
                assert st == 200, body
                statuses.append(st)

        tasks = [asyncio.create_task(worker()) for _ in range(6)]
        await until(lambda: len(statuses) >= 10)
        sims[0].kill()  # SIGKILL mid-run: requests on it fail and must be retried elsewhere
        killed_at = len(statuses)
        await asyncio.gather(*tasks)
        assert statuses == [200] * 72 and killed_at < 72  # every request answered, none lost
        # the stream that was already flowing ends cleanly: an error event, then [DONE]
        text = (await stream.read()).decode()
        events = [e for e in text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert "error" in orjson.loads(events[-2][6:])
        rep = r.state.pool.get("s0")
        assert rep is not None and not rep.state.healthy and rep.ejections >= 1
        assert all(st.in_flight == 0 for st in r.state.pool.all_states())
        got = {(await complete(s, r.url))[1] for _ in range(6)}
        assert got == {"s1", "s2"}
        sims[0].restart()
        await until(lambda: r.state.pool.get("s0").state.healthy, timeout=15)
        got = {(await complete(s, r.url))[1] for _ in range(6)}
        assert got == {"s0", "s1", "s2"}


async def test_disconnect_mid_stream_frees_router_and_engine(sims3):
    async with router(sims3) as r, aiohttp.ClientSession() as s:

        async def engines_idle() -> bool:
            return all([await engine_running(s, sim.url) == 0 for sim in sims3])

        await until(engines_idle)  # streams of earlier tests are gone
        streams = [await _open_stream(s, r.url) for _ in range(3)]
        assert [st.in_flight for st in r.state.pool.all_states()] == [1, 1, 1]
        for sim in sims3:
            assert await engine_running(s, sim.url) == 1
        for x in streams:
            x.close()  # the clients go away
        took = await until(lambda: all(st.in_flight == 0 for st in r.state.pool.all_states()))
        took_engine = await until(engines_idle)
        assert took < 1.5 and took_engine < 2.5  # cancelled within ~1 s (margin for a loaded machine)


async def test_weighted_from_yaml_spreads_by_load(sims3):
    options = {"scorers": {"load": 1.0, "kv_usage": 0.1}, "filters": {"max_kv_usage": 0.99}}
    async with router(sims3, "weighted", policy={"name": "weighted", "options": options}) as r, \
            aiohttp.ClientSession() as s:
        streams = [await _open_stream(s, r.url) for _ in range(3)]
        try:
            assert sorted(x.headers["x-kvrouter-replica"] for x in streams) == ["s0", "s1", "s2"]
        finally:
            for x in streams:
                x.close()
        text = await (await s.get(r.url + "/metrics")).text()
        assert 'kvrouter_decisions_total{policy="weighted",reason="weighted"} 3.0' in text
