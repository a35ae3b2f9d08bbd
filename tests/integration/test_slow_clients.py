"""Slow and abusive clients, over real sockets: a client that stops reading a stream is cut off
without stalling anyone else; silent, slow-header and surplus connections are closed; request
rates are limited per API key."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import aiohttp
import orjson
from aiohttp import web

from tests.integration.test_router import FakeEngine, assert_openai_error, fleet, post, start_router
from tests.support.services import free_port

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 1}


class EndlessEngine(FakeEngine):
    """Streams 4 KB events without end until the router goes away."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.streams_open = 0
        self.aborted = 0
        self.sent_bytes = 0

    async def _answer(self, request: web.Request, req: dict) -> web.StreamResponse:
        if not req.get("stream"):
            return await super()._answer(request, req)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = b"data: " + orjson.dumps({"choices": [{"index": 0, "text": "x" * 4000}]}) + b"\n\n"
        self.streams_open += 1
        try:
            while True:
                await resp.write(chunk)
                self.sent_bytes += len(chunk)
                await asyncio.sleep(0)
        except (ConnectionError, asyncio.CancelledError):
            self.aborted += 1
            raise
        finally:
            self.streams_open -= 1


def _raw_request(port: int, body: bytes, rcvbuf: int = 4096) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return s


async def _closed_by_peer(s: socket.socket, timeout: float) -> bool:
    """Drain ``s`` until the peer closes it (True) or ``timeout`` passes (False)."""
    s.setblocking(False)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        try:
            data = await asyncio.wait_for(loop.sock_recv(s, 65536), deadline - loop.time())
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
        if not data:
            return True
    return False


async def test_client_that_stops_reading_is_cut_off_without_stalling_others():
    engine = await EndlessEngine("endless").start()
    normal = await FakeEngine("normal", events=3).start()
    try:
        async with start_router([engine, normal], limits={"client_write_timeout_s": 1.0},
                                policy={"name": "round_robin"}) as router:
            port = router.port
            slow = _raw_request(port, orjson.dumps({**BODY, "stream": True}))  # never read
            await _until(lambda: engine.streams_open == 1, 10)
            # others keep being served at once while the stalled stream waits for its reader
            t0 = time.monotonic()
            for _ in range(10):
                status, headers, body = await post(router.url + "/v1/completions", BODY)
                assert status == 200
            assert time.monotonic() - t0 < 5.0
            # the router buffers a bounded amount, then gives up on the client ...
            await _until(lambda: engine.streams_open == 0, 15)
            assert engine.aborted == 1
            assert engine.sent_bytes < 64 * 2**20  # backpressure held the engine back
            # ... closes its connection and frees the replica's in-flight slot
            assert await _closed_by_peer(slow, 10)
            slow.close()
            states = {s.id: s.in_flight for s in router.state.pool.all_states()}
            assert states == {"endless": 0, "normal": 0}
            metrics = await _text(router.url + "/metrics")
            assert 'kvrouter_rejected_total{reason="client_write_timeout"} 1.0' in metrics
    finally:
        await engine.stop()
        await normal.stop()


async def test_silent_and_slow_header_connections_are_closed():
    async with fleet({}) as engines, start_router(engines, limits={"client_idle_timeout_s": 0.5}) as router:
        silent = [socket.create_connection(("127.0.0.1", router.port)) for _ in range(20)]
        slowloris = socket.create_connection(("127.0.0.1", router.port))
        slowloris.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")

        async def dribble() -> None:
            with contextlib.suppress(OSError):
                for _ in range(40):
                    slowloris.sendall(b"X")
                    await asyncio.sleep(0.1)

        task = asyncio.create_task(dribble())
        try:
            results = await asyncio.gather(*(_closed_by_peer(s, 10) for s in [*silent, slowloris]))
            assert all(results)
            status, _, _ = await post(router.url + "/v1/completions", BODY)
            assert status == 200  # real clients are unaffected
        finally:
            task.cancel()
            for s in [*silent, slowloris]:
                s.close()


async def test_connections_beyond_the_cap_are_refused_in_openai_shape():
    async with fleet({}) as engines, start_router(engines, limits={"max_connections": 8}) as router:
        held = [socket.create_connection(("127.0.0.1", router.port)) for _ in range(8)]
        await asyncio.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", router.port))
        extra.setblocking(False)
        loop = asyncio.get_running_loop()
        data = b""
        with contextlib.suppress(OSError, TimeoutError):
            while chunk := await asyncio.wait_for(loop.sock_recv(extra, 65536), 5):
                data += chunk
        extra.close()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503")
        assert orjson.loads(body)["error"]["code"] == "too_many_connections"
        for s in held:
            s.close()
        await asyncio.sleep(0.3)
        status, _, _ = await post(router.url + "/v1/completions", BODY)
        assert status == 200
        metrics = await _text(router.url + "/metrics")
        assert "kvrouter_connections_refused_total 1.0" in metrics


async def test_rate_limit_per_api_key():
    async with fleet({}) as engines, start_router(
            engines, auth={"api_keys": ["key-a", "key-b"]},
            limits={"rate_limit_rps": 0.05, "rate_limit_burst": 3}) as router:
        url = router.url + "/v1/completions"
        a = [await post(url, BODY, headers={"Authorization": "Bearer key-a"}) for _ in range(6)]
        assert [s for s, _, _ in a] == [200, 200, 200, 429, 429, 429]
        status, headers, body = a[-1]
        assert_openai_error(status, body, 429, "rate_limit_exceeded")
        assert int(headers["Retry-After"]) >= 1
        b = [await post(url, BODY, headers={"Authorization": "Bearer key-b"}) for _ in range(3)]
        assert [s for s, _, _ in b] == [200, 200, 200]  # another key has its own bucket
        metrics = await _text(router.url + "/metrics")
        assert 'kvrouter_rejected_total{reason="rate_limited"} 3.0' in metrics


def test_rate_limiter_refills_and_bounds_its_table():
    from router.ratelimit import RateLimiter

    rl = RateLimiter(rate=2.0, burst=2, max_keys=3)
    assert [rl.allow(b"k", 0.0)[0] for _ in range(3)] == [True, True, False]
    ok, wait = rl.allow(b"k", 0.1)
    assert not ok and 0.0 < wait <= 0.5
    assert rl.allow(b"k", 0.6)[0]  # refilled at 2/s
    for i in range(10):
        rl.allow(b"other%d" % i, 1.0)
    assert len(rl) == 3
    secret = b"sk-a-long-client-secret"
    rl.allow(secret, 2.0)
    assert all(len(d) == 16 and secret not in d for d in rl._buckets)  # keys kept as keyed digests


async def _until(cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def _text(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.text()


def test_limits_config_keys():
    import pytest

    from router.config import Config, ConfigError

    lim = Config.from_dict({}).limits
    assert (lim.max_connections, lim.client_idle_timeout_s, lim.client_write_timeout_s, lim.rate_limit_rps) == \
        (10_000, 75.0, 60.0, 0.0)
    with pytest.raises(ConfigError, match="limits.client_write_timeout_s"):
        Config.from_dict({"limits": {"client_write_timeout_s": 0}})
    with pytest.raises(ConfigError, match="limits.rate_limit_rps"):
        Config.from_dict({"limits": {"rate_limit_rps": -1}})
    assert free_port()
