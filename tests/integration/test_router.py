"""The router over real sockets against small fake engines (aiohttp servers on free ports).

The fakes speak enough of vLLM's API (``/health``, ``/metrics``, ``/v1/models``,
completions and chat, SSE streams) and can be told to fail in the ways the router must
handle: 5xx, 429, a slow first byte, a connection closed before the answer or mid-stream.
``FakeEngine`` and the ``start_router`` helper are imported by the other router tests.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict

from router.config import Config
from router.server import Server
from tests.support.services import free_port

MODEL = "fake-model"


class FakeEngine:
    """A vLLM-like engine. ``mode`` selects a failure: ok, http500, http429, close_early
    (connection dropped before any answer), break_stream (two events then the connection is
    dropped), slow (first byte after ``delay`` seconds), hang_stream (one event then nothing), truncated
    (two events and half of a third, then a clean end without ``[DONE]``)."""

    def __init__(self, name: str, model: str = MODEL, mode: str = "ok", delay: float = 0.0,
                 events: int = 5, event_gap: float = 0.0, health_status: int = 200) -> None:
        self.name = name
        self.model = model
        self.mode = mode
        self.delay = delay
        self.events = events
        self.event_gap = event_gap
        self.health_status = health_status
        self.port = free_port()
        self.running = 0
        self.seen: list[tuple[str, CIMultiDict[str], bytes]] = []
        self.cancelled = 0
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/{tail:.+}", self._infer)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (f'vllm:num_requests_running{{model_name="{self.model}",engine="0"}} {self.running}\n'
                f'vllm:num_requests_waiting{{model_name="{self.model}",engine="0"}} 0\n'
                f'vllm:kv_cache_usage_perc{{model_name="{self.model}",engine="0"}} 0.25\n')
        return web.Response(text=text, content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _infer(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append((request.path, CIMultiDict(request.headers), body))
        self.running += 1
        try:
            return await self._answer(request, orjson.loads(body))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1

    async def _answer(self, request: web.Request, req: dict[str, Any]) -> web.StreamResponse:
        if self.mode == "http500":
            return web.json_response({"error": {"message": f"boom from {self.name}", "type": "server_error",
                                                "param": None, "code": 500}}, status=500)
        if self.mode == "http429":
            return web.json_response({"error": {"message": "busy", "type": "rate_limit", "param": None,
                                                "code": 429}}, status=429)
        if self.mode == "close_early":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(0.05)
            return web.Response()
        if self.delay:
            await asyncio.sleep(self.delay)
        chat = request.path.endswith("/chat/completions")
        if not req.get("stream"):
            out = {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
                   "model": self.model, "served_by": self.name,
                   "choices": [{"index": 0, "finish_reason": "length",
                                **({"message": {"role": "assistant", "content": "hi"}} if chat else {"text": "hi"})}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
            return web.json_response(out, headers={"x-engine": self.name})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-engine": self.name})
        await resp.prepare(request)
        for i in range(self.events):
            if self.mode == "break_stream" and i == 2:
                assert request.transport is not None
                request.transport.close()
                return resp
            if self.mode == "hang_stream" and i == 1:
                await asyncio.sleep(3600)
            if self.mode == "truncated" and i == 2:  # half an event, then a clean end, no [DONE]
                await resp.write(b'data: {"id": "c1", "choi')
                await resp.write_eof()
                return resp
            delta = {"delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"}
            chunk = {"id": "c1", "object": "chat.completion.chunk" if chat else "text_completion",
                     "model": self.model, "choices": [{"index": 0, **delta, "finish_reason": None}]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            if self.event_gap:
                await asyncio.sleep(self.event_gap)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def router_config(engines: list[FakeEngine], **sections: Any) -> Config:
    d: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "policy": {"name": "round_robin"},  # these tests count on round-robin order (default: cache_aware)
        "replicas": [{"id": e.name, "url": e.url, "models": [e.model]} for e in engines],
        # a generous health timeout: these fakes share the test's event loop, and a check that
        # times out on a loaded machine would eject a healthy replica (failure_threshold 1)
        "health": {"interval_s": 0.2, "timeout_s": 10.0, "failure_threshold": 1, "success_threshold": 1},
        "scrape": {"interval_s": 0.2},
        "upstream": {"retry_backoff_s": 0.01, "first_byte_timeout_s": 10, "idle_timeout_s": 10},
        "logging": {"requests": False},
    }
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v} if isinstance(v, dict) else v
    return Config.from_dict(d)


@contextlib.asynccontextmanager
async def start_router(engines: list[FakeEngine], **sections: Any):
    server = await Server(router_config(engines, **sections), seed=0).start()
    try:
        yield server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def fleet(*specs: dict[str, Any]):
    engines = [await FakeEngine(f"e{i}", **s).start() for i, s in enumerate(specs)]
    try:
        yield engines
    finally:
        for e in engines:
            await e.stop()


async def post(url: str, body: Any, headers: dict[str, str] | None = None,
               raw: bytes | None = None) -> tuple[int, CIMultiDict[str], bytes]:
    async with aiohttp.ClientSession() as s, s.post(url, data=raw if raw is not None else orjson.dumps(body),
                                                    headers={"Content-Type": "application/json",
                                                             **(headers or {})}) as r:
        return r.status, CIMultiDict(r.headers), await r.read()


def assert_openai_error(status: int, body: bytes, want_status: int, code: str | None = None) -> dict[str, Any]:
    assert status == want_status, body
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    return err


# ---------------------------------------------------------------------- tests


async def test_non_stream_forwards_bytes_unchanged_and_names_replica():
    async with fleet({}, {}, {}) as engines, start_router(engines) as router:
        raw = b'{"model": "fake-model",   "prompt": "hello", "max_tokens": 1, "extra_field": [1, 2]}'
        seen_replicas = []
        for _ in range(3):
            status, headers, body = await post(router.url + "/v1/completions", None,
                                               headers={"X-Request-Id": "rid-123"}, raw=raw)
            assert status == 200
            assert orjson.loads(body)["choices"][0]["text"] == "hi"
            assert headers["x-request-id"] == "rid-123"
            seen_replicas.append(headers["x-kvrouter-replica"])
        assert sorted(seen_replicas) == ["e0", "e1", "e2"]  # round robin over three
        for e in engines:
            path, hdrs, body = e.seen[0]
            assert body == raw  # original bytes, not re-serialised
            assert hdrs["X-Request-Id"] == "rid-123"
            assert "Accept-Encoding" not in hdrs


async def test_stream_passes_every_event_and_done():
    async with fleet({"events": 7}) as engines, start_router(engines) as router:
        async with aiohttp.ClientSession() as s, s.post(router.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            text = (await r.read()).decode()
        events = [e for e in text.split("\n\n") if e]
        assert len(events) == 8 and events[-1] == "data: [DONE]"
        assert "x-request-id" in r.headers


async def test_errors_are_openai_shaped():
    async with fleet({}) as engines, start_router(engines, limits={"max_body_bytes": 1000}) as router:
        st, _, b = await post(router.url + "/v1/completions", {"model": "nope", "prompt": "x"})
        assert_openai_error(st, b, 404, "model_not_found")
        st, _, b = await post(router.url + "/v1/completions", None, raw=b"{not json")
        assert_openai_error(st, b, 400, "invalid_json")
        st, _, b = await post(router.url + "/v1/completions", None, raw=b"[1, 2]")
        assert_openai_error(st, b, 400, "invalid_json")
        st, _, b = await post(router.url + "/v1/completions", {"model": MODEL, "prompt": "x" * 2000})
        assert_openai_error(st, b, 413, "body_too_large")
        st, _, b = await post(router.url + "/v1/completions", {"model": 7, "prompt": "x"})
        assert_openai_error(st, b, 400, "invalid_model")
        async with aiohttp.ClientSession() as s, s.get(router.url + "/nowhere") as r:
            assert_openai_error(r.status, await r.read(), 404, "not_found")
        # the only configured model is the default when the body names none (as vLLM does)
        st, _, b = await post(router.url + "/v1/completions", {"prompt": "x"})
        assert st == 200


async def test_retry_on_5xx_and_429_before_first_byte():
    async with fleet({"mode": "http500"}, {"mode": "http429"}, {}) as engines, \
            start_router(engines, policy={"name": "round_robin"}) as router:
        for _ in range(6):
            st, h, b = await post(router.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
            assert st == 200 and h["x-kvrouter-replica"] == "e2"
        text = await get_text(router.url + "/metrics")
        assert 'kvrouter_retries_total{model="fake-model",reason="http_500"}' in text


async def test_all_replicas_failing_returns_engine_error_after_bounded_retries():
    async with fleet({"mode": "http500"}, {"mode": "http500"}) as engines, \
            start_router(engines, upstream={"max_retries": 5}) as router:
        st, _, b = await post(router.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert st == 500 and "boom" in orjson.loads(b)["error"]["message"]
        # each replica tried once: the retry excludes replicas already tried
        assert sum(len(e.seen) for e in engines) == 2


async def test_connection_refused_ejects_and_retries():
    async with fleet({}, {}, {}) as engines, start_router(engines, health={"interval_s": 30}) as router:
        await engines[1].stop()  # down between health checks
        for _ in range(6):
            st, h, _ = await post(router.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
            assert st == 200 and h["x-kvrouter-replica"] != "e1"
        rep = router.state.pool.get("e1")
        assert rep is not None and not rep.state.healthy
        async with aiohttp.ClientSession() as s, s.get(router.url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == [MODEL]


async def test_close_before_answer_is_retried():
    async with fleet({"mode": "close_early"}, {}) as engines, start_router(engines) as router:
        for _ in range(4):
            st, h, _ = await post(router.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
            assert st == 200 and h["x-kvrouter-replica"] == "e1"


async def stream_events(url: str) -> list[str]:
    """The SSE events of one streamed completion through the router (status 200 asserted)."""
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={
            "model": MODEL, "prompt": "x", "stream": True}) as r:
        assert r.status == 200
        return [e for e in (await r.read()).decode().split("\n\n") if e]


async def test_mid_stream_failure_ends_with_error_event_and_done():
    async with fleet({"mode": "break_stream"}) as engines, start_router(engines) as router:
        events = await stream_events(router.url)
        assert events[-1] == "data: [DONE]"
        err = orjson.loads(events[-2][len("data: "):])["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "upstream_error"
        assert all(orjson.loads(e[6:])["choices"] for e in events[:-2])  # the two good events, intact


async def test_truncated_stream_ends_with_a_separate_error_event_and_done():
    """The engine ends the stream inside an event and without [DONE]: the half event is
    passed on, then the error event is a separate event (before the fix it was glued to
    the half event: ``data: {partial}data: {error}``)."""
    async with fleet({"mode": "truncated"}) as engines, start_router(engines) as router:
        events = await stream_events(router.url)
        assert events[-1] == "data: [DONE]"
        err = orjson.loads(events[-2][len("data: "):])["error"]
        assert err["code"] == "upstream_error" and "before [DONE]" in err["message"]
        assert all(orjson.loads(e[6:])["choices"] for e in events[:2])
        assert events[2] == 'data: {"id": "c1", "choi'


async def test_idle_timeout_mid_stream_ends_cleanly():
    async with fleet({"mode": "hang_stream"}) as engines, \
            start_router(engines, upstream={"idle_timeout_s": 0.5}) as router:
        events = await stream_events(router.url)
        assert events[-1] == "data: [DONE]"
        assert orjson.loads(events[-2][6:])["error"]["code"] == "upstream_timeout"
        await _until(lambda: engines[0].running == 0)


async def test_client_disconnect_mid_stream_frees_router_and_engine():
    async with fleet({"events": 1000, "event_gap": 0.02}) as engines, start_router(engines) as router:
        state = router.state.pool.get("e0").state
        async with aiohttp.ClientSession() as s:
            r = await s.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
            await r.content.readuntil(b"\n\n")
            assert state.in_flight == 1 and engines[0].running == 1
            r.close()  # the client goes away mid-stream
        loop = asyncio.get_running_loop()
        t = loop.time()
        await _until(lambda: state.in_flight == 0 and engines[0].running == 0, timeout=5)
        assert loop.time() - t < 1.5  # the issue asks for < 1 s; margin for a loaded machine
        assert engines[0].cancelled == 1


async def test_auth_and_limits():
    async with fleet({"delay": 0.5}) as engines, start_router(
            engines, auth={"api_keys": ["k1", "k2"], "admin_key": "adm"},
            limits={"max_concurrent": 2, "retry_after_s": 3}) as router:
        u = router.url + "/v1/completions"
        st, h, b = await post(u, {"model": MODEL, "prompt": "x"})
        assert_openai_error(st, b, 401, "invalid_api_key")
        st, _, b = await post(u, {"model": MODEL, "prompt": "x"}, headers={"Authorization": "Bearer bad"})
        assert_openai_error(st, b, 401, "invalid_api_key")
        results = await asyncio.gather(*(post(u, {"model": MODEL, "prompt": "x"},
                                              headers={"Authorization": "Bearer k2"}) for _ in range(4)))
        statuses = sorted(r[0] for r in results)
        assert statuses == [200, 200, 429, 429]
        limited = next(r for r in results if r[0] == 429)
        assert limited[1]["Retry-After"] == "3"
        assert_openai_error(limited[0], limited[2], 429, "too_many_requests")
        # the router's client key is not sent on to the engine
        assert all("Authorization" not in hdrs for _, hdrs, _ in engines[0].seen)
        async with aiohttp.ClientSession() as s:
            async with s.get(router.url + "/admin/replicas") as r:
                assert r.status == 401
            async with s.get(router.url + "/admin/replicas", headers={"Authorization": "Bearer adm"}) as r:
                assert [x["id"] for x in (await r.json())["replicas"]] == ["e0"]
            async with s.get(router.url + "/v1/models") as r:
                assert r.status == 401


async def test_replica_api_key_is_sent_upstream():
    async with fleet({}) as engines:
        cfg = router_config(engines).to_dict()
        cfg["replicas"][0]["api_key"] = "upstream-secret"
        server = await Server(Config.from_dict(cfg)).start()
        try:
            st, _, _ = await post(server.url + "/v1/completions", {"model": MODEL, "prompt": "x"},
                                  headers={"Authorization": "Bearer client"})
            assert st == 200
            assert engines[0].seen[0][1]["Authorization"] == "Bearer upstream-secret"
        finally:
            await server.stop()


async def test_health_ready_metrics_and_readmission():
    async with fleet({}, {}) as engines, start_router(engines) as router:
        async with aiohttp.ClientSession() as s:
            async with s.get(router.url + "/ready") as r:
                assert r.status == 200
            engines[0].health_status = 503
            engines[1].health_status = 503
            await _until(lambda: not any(x.healthy for x in router.state.pool.all_states()))
            async with s.get(router.url + "/ready") as r:
                assert r.status == 503
            st, _, b = await post(router.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
            assert_openai_error(st, b, 503, "no_healthy_replica")
            engines[1].health_status = 200
            await _until(lambda: router.state.pool.get("e1").state.healthy)
            st, h, _ = await post(router.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
            assert st == 200 and h["x-kvrouter-replica"] == "e1"
            async with s.get(router.url + "/health") as r:
                assert r.status == 200
        text = await get_text(router.url + "/metrics")
        for name in ("kvrouter_requests_total", "kvrouter_request_duration_seconds_bucket",
                     "kvrouter_router_overhead_seconds_bucket", "kvrouter_replica_in_flight",
                     'kvrouter_replica_healthy{replica="e0"} 0.0', "kvrouter_decisions_total",
                     'kvrouter_replica_kv_usage{replica="e1"} 0.25'):
            assert name in text, name


async def test_passthrough_other_v1_post():
    async with fleet({}) as engines, start_router(engines) as router:
        st, _, _ = await post(router.url + "/v1/embeddings", {"model": MODEL, "input": "x"})
        assert st == 200 and engines[0].seen[0][0] == "/v1/embeddings"


# ---------------------------------------------------------------------- helpers


async def get_text(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.text()


async def _until(cond, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            pytest.fail("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_hop_by_hop_stripped_and_request_id_generated():
    async with fleet({}) as engines, start_router(engines) as router:
        st, h, _ = await post(router.url + "/v1/completions", {"model": MODEL, "prompt": "x"},
                              headers={"TE": "trailers", "Proxy-Authorization": "Basic x", "X-Custom": "kept",
                                       "Upgrade": "h2c", "Accept-Encoding": "gzip"})
        assert st == 200
        rid = h["x-request-id"]
        assert len(rid) == 24 and rid.isalnum()
        _, hdrs, _ = engines[0].seen[0]
        assert hdrs["X-Custom"] == "kept" and hdrs["X-Request-Id"] == rid
        for gone in ("TE", "Proxy-Authorization", "Upgrade", "Accept-Encoding"):
            assert gone not in hdrs, gone
        assert "x-engine" in h  # the engine's own response headers come back


async def test_header_limits_give_a_4xx():
    async with fleet({}) as engines, start_router(engines, limits={"max_header_field_bytes": 1024}) as router:
        async with aiohttp.ClientSession() as s, s.post(router.url + "/v1/completions",
                                                        json={"model": MODEL, "prompt": "x"},
                                                        headers={"X-Big": "a" * 4000}) as r:
            assert 400 <= r.status < 500
        assert engines[0].seen == []


async def test_json_request_log_has_id_replica_and_reason():
    import io

    from router.config import LoggingConfig
    from router.logs import setup_logging

    buf = io.StringIO()
    setup_logging(LoggingConfig(format="json", level="info"), stream=buf)
    try:
        async with fleet({}) as engines, start_router(engines, logging={"requests": True}) as router:
            st, h, _ = await post(router.url + "/v1/completions", {"model": MODEL, "prompt": "x"},
                                  headers={"X-Request-Id": "log-me"})
            assert st == 200
    finally:
        setup_logging(LoggingConfig())
    lines = [orjson.loads(x) for x in buf.getvalue().splitlines() if x.startswith("{")]
    rec = next(x for x in lines if x.get("request_id") == "log-me")
    assert rec["replica"] == "e0" and rec["reason"] == "round_robin" and rec["status"] == 200
    assert rec["model"] == MODEL and rec["level"] == "info" and rec["ms"] >= 0


async def test_first_byte_timeout_retried_then_504():
    async with fleet({"delay": 3.0}, {}) as engines, \
            start_router(engines, upstream={"first_byte_timeout_s": 0.5}) as router:
        st, h, _ = await post(router.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert st == 200 and h["x-kvrouter-replica"] == "e1"  # e0 too slow: retried on e1
        await _until(lambda: engines[0].running == 0)  # the abandoned attempt was closed upstream
    async with fleet({"delay": 3.0}, {"delay": 3.0}) as engines, \
            start_router(engines, upstream={"first_byte_timeout_s": 0.3}) as router:
        st, _, b = await post(router.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert_openai_error(st, b, 504, "upstream_timeout")


async def test_client_gone_before_a_non_stream_answer_cancels_upstream():
    async with fleet({"delay": 5.0}) as engines, start_router(engines) as router:
        state = router.state.pool.get("e0").state
        with pytest.raises(asyncio.TimeoutError):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as s:
                await s.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
        await _until(lambda: state.in_flight == 0 and engines[0].running == 0, timeout=5)
        assert engines[0].cancelled == 1
        text = await get_text(router.url + "/metrics")
        assert 'kvrouter_requests_total{model="fake-model",replica="e0",status="499"} 1.0' in text


async def test_admin_add_and_remove_replicas():
    async with fleet({}, {}) as engines, start_router(engines[:1], auth={"admin_key": "adm"}) as router:
        adm = {"Authorization": "Bearer adm"}
        async with aiohttp.ClientSession() as s:
            async with s.post(router.url + "/admin/replicas", json={"id": "new", "url": "nope", "models": [MODEL]},
                              headers=adm) as r:
                err = assert_openai_error(r.status, await r.read(), 400, "invalid_replica")
                assert err["message"].startswith("url: must be http(s)://host:port")
            async with s.post(router.url + "/admin/replicas", json={"id": "new", "url": engines[1].url,
                                                                      "models": [MODEL]}, headers=adm) as r:
                assert r.status == 201 and (await r.json()) == {"id": "new", "healthy": True}
            got = {(await post(router.url + "/v1/completions", {"model": MODEL, "prompt": "x"}))[1]
                   ["x-kvrouter-replica"] for _ in range(4)}
            assert got == {"e0", "new"}
            async with s.delete(router.url + "/admin/replicas/new", headers=adm) as r:
                assert r.status == 200
            async with s.delete(router.url + "/admin/replicas/new", headers=adm) as r:
                assert_openai_error(r.status, await r.read(), 404, "replica_not_found")
            got = {(await post(router.url + "/v1/completions", {"model": MODEL, "prompt": "x"}))[1]
                   ["x-kvrouter-replica"] for _ in range(3)}
            assert got == {"e0"}
