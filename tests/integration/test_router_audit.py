"""Audit fixes over real sockets: ``Connection``-named headers are hop-by-hop in both
directions (RFC 9110 §7.6.1), a wrong method on a known path is a 405 with ``Allow``, and
``/debug/route`` rejects an unreadable prompt with an OpenAI-style 400."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from tests.integration.test_router import MODEL, FakeEngine, assert_openai_error, post, start_router

ADMIN = "admin-key"


class ConnectionNamingEngine(FakeEngine):
    """Answers with a ``Connection`` header naming one of its own headers as hop-by-hop."""

    async def _answer(self, request: web.Request, req: dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": self.model,
                                  "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}]},
                                 headers={"Connection": "keep-alive, X-Engine-Secret",
                                          "X-Engine-Secret": "engine-only", "X-Engine-Public": "kept"})


async def raw_request(url: str, head: str, body: bytes) -> tuple[int, CIMultiDict[str], bytes]:
    """One HTTP/1.1 request written byte for byte (no client library rewrites ``Connection``)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 30)
        headers: CIMultiDict[str] = CIMultiDict()
        while (line := await asyncio.wait_for(reader.readline(), 30)) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers.add(k.strip(), v.strip())
        data = await asyncio.wait_for(reader.readexactly(int(headers["Content-Length"])), 30)
        return int(status_line.split()[1]), headers, data
    finally:
        writer.close()


async def test_headers_named_by_the_clients_connection_header_do_not_reach_the_replica():
    engine = await FakeEngine("e0").start()
    try:
        async with start_router([engine]) as router:
            body = orjson.dumps({"model": MODEL, "prompt": "x"})
            head = ("POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                    "Connection: keep-alive, X-Client-Secret\r\nConnection: X-Other-Hop\r\n"
                    "X-Client-Secret: hunter2\r\nX-Other-Hop: 1\r\nX-Custom: kept\r\n")
            status, _, _ = await raw_request(router.url, head, body)
            assert status == 200
            _, seen, got = engine.seen[-1]
            assert got == body
            assert seen["X-Custom"] == "kept"
            for gone in ("X-Client-Secret", "X-Other-Hop"):
                assert gone not in seen, gone
            # a plain keep-alive request keeps every end-to-end header
            status, _, _ = await raw_request(router.url, head.replace("Connection: X-Other-Hop\r\n", "")
                                             .replace("keep-alive, X-Client-Secret", "keep-alive"), body)
            assert status == 200
            assert engine.seen[-1][1]["X-Client-Secret"] == "hunter2"
    finally:
        await engine.stop()


async def test_headers_named_by_the_replicas_connection_header_do_not_reach_the_client():
    engine = await ConnectionNamingEngine("e0").start()
    try:
        async with start_router([engine]) as router:
            status, headers, body = await post(router.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
            assert status == 200, body
            assert headers["X-Engine-Public"] == "kept"
            assert "X-Engine-Secret" not in headers
            assert orjson.loads(body)["choices"][0]["text"] == "hi"
    finally:
        await engine.stop()


async def test_wrong_method_on_a_known_path_is_405_with_allow():
    engine = await FakeEngine("e0").start()
    try:
        async with start_router([engine]) as router, aiohttp.ClientSession() as s:
            for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):
                for method in ("GET", "PUT", "DELETE"):
                    async with s.request(method, router.url + path) as r:
                        assert_openai_error(r.status, await r.read(), 405, "method_not_allowed")
                        assert r.headers["Allow"] == "POST", (method, path)
            async with s.delete(router.url + "/v1/models") as r:
                assert_openai_error(r.status, await r.read(), 405, "method_not_allowed")
                assert set(r.headers["Allow"].split(", ")) == {"GET", "HEAD", "POST"}
            async with s.get(router.url + "/no/such/path") as r:
                assert_openai_error(r.status, await r.read(), 404, "not_found")
                assert "Allow" not in r.headers
        assert engine.seen == []
    finally:
        await engine.stop()


async def test_debug_route_rejects_an_unreadable_prompt_like_the_proxied_endpoints():
    engine = await FakeEngine("e0").start()
    auth = {"Authorization": f"Bearer {ADMIN}"}
    try:
        async with start_router([engine], policy={"name": "cache_aware"}, auth={"admin_key": ADMIN},
                                models={MODEL: {"tokenizer": "builtin", "block_size": 4}}) as router:
            url = router.url + "/debug/route"
            for body, param in (({"model": MODEL, "prompt": 5}, "prompt"),
                                ({"model": MODEL}, "prompt"),
                                ({"model": MODEL, "prompt": {"a": 1}}, "prompt"),
                                ({"model": MODEL, "prompt": [1, "a", None]}, "prompt"),
                                ({"model": MODEL, "messages": "hello"}, "messages"),
                                ({"model": MODEL, "messages": []}, "messages"),
                                ({"model": MODEL, "messages": [{"content": "no role"}]}, "messages[0]")):
                status, _, out = await post(url, body, headers=auth)
                err = assert_openai_error(status, out, 400, "invalid_prompt")
                assert err["param"] == param and err["type"] == "invalid_request_error", body
            for body in ({"model": MODEL, "prompt": "abcdefgh"}, {"model": MODEL, "prompt": [1, 2, 3, 4]},
                         {"model": MODEL, "prompt": ["abcd", "efgh"]}, {"model": MODEL, "prompt": [[1, 2, 3, 4]]},
                         {"model": MODEL, "messages": [{"role": "user", "content": "abcdefgh"}]}):
                status, _, out = await post(url, body, headers=auth)
                assert status == 200, out
                assert orjson.loads(out)["num_tokens"] >= 4, body
        assert engine.seen == []
    finally:
        await engine.stop()
