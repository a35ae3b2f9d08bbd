"""Circuit breaker: the pure state machine (explicit clock), then over real sockets: an engine
that returns 500s, garbage, answers too slowly or breaks its streams is taken out of rotation
by its breaker, probed when half-open, and back once healthy; the rest of the fleet carries on."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
from aiohttp import web

from router.breaker import CLOSED, HALF_OPEN, OPEN, Breakers, CircuitBreaker
from router.protect import breaker_outcome, deferred_outcome, maybe_request_fault
from tests.integration.test_router import FakeEngine, fleet, post, start_router
from tests.support.services import free_port

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 1}


def test_breaker_state_machine():
    b = CircuitBreaker(failure_threshold=3, open_s=10.0, success_threshold=2)
    assert b.allows(0.0)
    assert b.finished(False, 1.0) is None and b.finished(False, 2.0) is None
    assert b.finished(True, 2.5) is None  # a success resets the count
    assert [b.finished(False, t) for t in (3.0, 4.0, 5.0)] == [None, None, OPEN]
    assert not b.allows(5.0) and not b.allows(14.9)
    assert b.allows(15.0) and b.state == HALF_OPEN
    b.started(15.0)
    assert not b.allows(15.1)  # one probe at a time
    assert b.finished(False, 16.0) == OPEN  # a failed probe re-opens
    assert not b.allows(25.9) and b.allows(26.0)
    b.started(26.0)
    assert b.finished(True, 26.5) is None and b.state == HALF_OPEN
    b.started(27.0)
    assert b.finished(True, 27.5) == CLOSED
    assert b.opens == 2


def test_cancelled_probe_frees_the_slot():
    b = CircuitBreaker(failure_threshold=1, open_s=1.0, success_threshold=1)
    b.finished(False, 0.0)
    assert b.allows(1.0)
    b.started(1.0)
    b.finished(None, 1.2)  # the client went away: neither verdict
    assert b.state == HALF_OPEN and b.allows(1.3)


def test_breakers_block_and_report_changes():
    changes: list[tuple[str, str]] = []
    bs = Breakers(failure_threshold=2, open_s=5.0, success_threshold=1,
                  on_change=lambda r, s: changes.append((r, s)))
    assert bs.blocked(0.0) == frozenset()
    bs.finished("a", False, 0.0)
    bs.finished("a", False, 0.1)
    bs.finished("b", True, 0.1)
    assert bs.blocked(1.0) == {"a"}
    assert bs.blocked(5.2) == frozenset()  # half-open: a probe may go
    bs.started("a", 5.2)
    assert bs.blocked(5.3) == {"a"}
    bs.finished("a", True, 5.4)
    assert bs.blocked(5.5) == frozenset()
    assert changes == [("a", OPEN), ("a", HALF_OPEN), ("a", CLOSED)]
    disabled = Breakers(failure_threshold=1, enabled=False)
    disabled.finished("a", False, 0.0)
    assert disabled.blocked(0.0) == frozenset()


def test_outcome_classification():
    assert breaker_outcome(200, False) is True
    assert breaker_outcome(400, False) is True  # the engine works; the client erred
    assert breaker_outcome(502, False) is False
    assert breaker_outcome(502, True) is False
    assert breaker_outcome(429, True) is None
    assert breaker_outcome(499, False) is None
    assert maybe_request_fault(500) and not maybe_request_fault(502) and not maybe_request_fault(504)
    assert deferred_outcome(200) is False  # another replica served the request: the 500 was the replica's
    assert deferred_outcome(500) is None and deferred_outcome(400) is None and deferred_outcome(0) is None


class PoisonEngine(FakeEngine):
    """Answers 500 to one prompt (a request that crashes the engine's handler), 200 otherwise."""

    async def _answer(self, request: web.Request, req: dict[str, Any]) -> web.StreamResponse:
        if req.get("prompt") == "poison":
            return web.json_response({"error": {"message": "handler crashed", "type": "server_error",
                                                "param": None, "code": 500}}, status=500)
        return await super()._answer(request, req)


async def test_a_poison_request_does_not_open_the_breakers():
    """A request that every engine answers with 500 is the request's fault, not the replicas':
    repeated, it must not open their breakers (before: 2 such requests opened all three and
    every caller got 503)."""
    engines = [await PoisonEngine(f"e{i}").start() for i in range(3)]
    try:
        async with start_router(engines, breaker=BREAKER, **QUIET) as router:
            for _ in range(6):
                status, _, body = await post(router.url + "/v1/completions", {**BODY, "prompt": "poison"})
                assert status == 500 and b"handler crashed" in body
            assert sum(len(e.seen) for e in engines) == 18  # each tried on all three (2 retries)
            assert set(router.state.proxy.breakers.states().values()) <= {CLOSED}
            served = await _served(router.url, 3)
            assert set(served) == {"e0", "e1", "e2"}
    finally:
        for e in engines:
            await e.stop()


BREAKER = {"failure_threshold": 2, "open_s": 1.0, "success_threshold": 1}
# health checks would also eject a dead engine; keep them out of the way (their answers are 200)
QUIET = {"health": {"interval_s": 30.0}, "scrape": {"interval_s": 30.0}}


async def _served(url: str, n: int) -> list[str]:
    out = []
    for _ in range(n):
        status, headers, body = await post(url + "/v1/completions", BODY)
        assert status == 200, body
        out.append(headers["x-kvrouter-replica"])
    return out


async def test_engine_returning_500s_is_cut_off_probed_and_readmitted():
    async with fleet({"mode": "http500"}, {}, {}) as engines, \
            start_router(engines, breaker=BREAKER, auth={"admin_key": "adm"}, **QUIET) as router:
        bad = engines[0]
        served = await _served(router.url, 12)
        assert "e0" not in served  # every request retried onto a good replica
        assert len(bad.seen) == 2  # the breaker opened after two failures; nothing since
        st = router.state.proxy.breakers.get("e0")
        assert st.state == OPEN
        metrics = (await _get(router.url + "/metrics")).decode()
        assert 'kvrouter_breaker_state{replica="e0"} 1.0' in metrics
        assert 'kvrouter_breaker_opened_total{replica="e0"} 1.0' in metrics
        import aiohttp

        async with aiohttp.ClientSession() as s, s.get(router.url + "/admin/replicas",
                                                       headers={"Authorization": "Bearer adm"}) as r:
            listed = {x["id"]: x["breaker"] for x in (await r.json())["replicas"]}
        assert listed == {"e0": "open", "e1": "closed", "e2": "closed"}
        bad.mode = "ok"  # the engine recovers
        await asyncio.sleep(1.1)
        served = await _served(router.url, 9)
        assert st.state == CLOSED
        assert "e0" in served  # probe succeeded; back in rotation
        assert served.count("e0") >= 2


async def test_slow_engine_is_retried_elsewhere_and_opened():
    async with fleet({"delay": 5.0}, {}) as engines, start_router(
            engines, breaker=BREAKER, upstream={"first_byte_timeout_s": 0.3, "retry_backoff_s": 0.01},
            **QUIET) as router:
        served = await _served(router.url, 6)
        assert set(served) == {"e1"}
        assert router.state.proxy.breakers.get("e0").state == OPEN
        assert len(engines[0].seen) == 2


async def test_broken_streams_open_the_breaker_and_end_cleanly():
    async with fleet({"mode": "break_stream"}, {}) as engines, \
            start_router(engines, breaker=BREAKER, policy={"name": "round_robin"}, **QUIET) as router:
        errors = 0
        for _ in range(8):
            status, _, body = await post(router.url + "/v1/completions", {**BODY, "stream": True})
            assert status == 200
            assert body.endswith(b"data: [DONE]\n\n")
            if b'"error"' in body:
                errors += 1
        assert errors == 2  # two broken streams (clean error events), then e0 is skipped
        assert router.state.proxy.breakers.get("e0").state == OPEN


@contextlib.asynccontextmanager
async def garbage_engine():
    """Healthy on GET (health checks, metrics), but answers POSTs with bytes that are not HTTP."""
    hits = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal hits
        with contextlib.suppress(Exception):
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            else:
                hits += 1
                writer.write(b"\x00\xffNOT HTTP AT ALL\r\n\r\n{{{{")
            await writer.drain()
        writer.close()

    port = free_port()
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}", lambda: hits
    finally:
        server.close()
        await server.wait_closed()


async def test_garbage_answers_open_the_breaker():
    async with garbage_engine() as (gurl, hits), fleet({}) as engines:
        from router.config import Config
        from router.server import Server
        from tests.integration.test_router import router_config

        base = router_config(engines, breaker=BREAKER, **QUIET).to_dict()
        base["replicas"].insert(0, {"id": "garbage", "url": gurl, "models": ["fake-model"]})
        server = await Server(Config.from_dict(base), seed=0).start()
        try:
            served = await _served(server.url, 8)
            assert set(served) == {"e0"}
            assert server.state.proxy.breakers.get("garbage").state == OPEN
            assert hits() == 2
        finally:
            await server.stop()


async def _get(url: str) -> bytes:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.read()


def test_breaker_config_validated():
    import pytest

    from router.config import Config, ConfigError

    assert Config.from_dict({}).breaker.failure_threshold == 5
    with pytest.raises(ConfigError, match="breaker.open_s"):
        Config.from_dict({"breaker": {"open_s": 0}})
    with pytest.raises(ConfigError, match="breaker.failure_threshold"):
        Config.from_dict({"breaker": {"failure_threshold": 0}})
    assert orjson.dumps(Config.from_dict({"breaker": {"enabled": False}}).to_dict()["breaker"])


async def test_a_removed_replica_drops_its_breaker():
    async with fleet({"mode": "http500"}, {}) as engines, start_router(
            engines, breaker=BREAKER, auth={"admin_key": "adm"}, **QUIET) as router:
        await _served(router.url, 4)
        breakers = router.state.proxy.breakers
        assert breakers.states()["e0"] == OPEN
        router.state.pool.remove("e0")
        assert "e0" not in breakers.states() and breakers.blocked(0.0) == frozenset()
