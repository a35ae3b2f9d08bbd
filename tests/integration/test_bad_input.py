"""Bad input, fuzzed and hand-written: the router never crashes, never answers 5xx for a
client's mistake, always answers errors in OpenAI's shape, passes unknown fields (and every
other byte of a body it accepts) to the engine untouched, and keeps its memory bounded.

The router (``cache_aware``, so every body is also tokenized and hashed) and a fake engine
that records what it receives run in a background thread with their own event loop; the
tests talk to them over real sockets. The hand-written cases are ``tests/data/bad_requests.jsonl``
(``expect``: ``reject`` = a 4xx OpenAI error, with ``status``/``code`` when given, and nothing
sent upstream; ``forward`` = the engine receives exactly the bytes sent; ``headers`` are sent
with the body; ``encode``: gzip/deflate the body and send it with that ``Content-Encoding``,
the engine must then receive the plain body and no ``Content-Encoding``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.config import Config
from router.server import Server
from tests.integration.test_router import FakeEngine, router_config
from tests.support.services import Proc, kvrouter_argv

CORPUS = Path(__file__).resolve().parents[1] / "data" / "bad_requests.jsonl"
MODEL = "fake-model"
ADMIN = "admin-secret"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Stack:
    """A fake engine and a router served from a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.engine: FakeEngine
        self.server: Server

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def start(self) -> Stack:
        self.thread.start()
        self.engine = self.call(FakeEngine("e0", events=2).start())
        cfg = router_config([self.engine], policy={"name": "cache_aware"},
                            models={MODEL: {"tokenizer": "builtin", "block_size": 16}},
                            limits={"max_body_bytes": 4 * 2**20}, auth={"admin_key": ADMIN})
        self.server = self.call(Server(cfg, seed=0).start())
        return self

    def stop(self) -> None:
        self.call(self.server.stop())
        self.call(self.engine.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack().start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        yield c


def assert_error_shape(status: int, body: bytes) -> dict[str, Any]:
    assert 400 <= status < 500, (status, body[:300])
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    return err


def post_bytes(client: httpx.Client, stack: Stack, body: bytes, path: str = "/v1/completions",
               headers: dict[str, str] | None = None) -> tuple[int, bytes, bytes | None]:
    """(status, response body, bytes the engine received for this request or None)."""
    before = len(stack.engine.seen)
    r = client.post(path, content=body, headers={"Content-Type": "application/json", **(headers or {})})
    seen = stack.engine.seen[before:]
    assert len(seen) <= 1
    return r.status_code, r.content, seen[0][2] if seen else None


def raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        with contextlib.suppress(OSError):
            s.sendall(data)
        out = b""
        deadline = time.monotonic() + timeout
        with contextlib.suppress(OSError):
            while time.monotonic() < deadline and (chunk := s.recv(65536)):
                out += chunk
    return out


def _corpus() -> list[dict[str, Any]]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("case", _corpus(), ids=lambda c: c["name"])
def test_corpus(case: dict[str, Any], stack: Stack, client: httpx.Client) -> None:
    if "raw" in case:
        raw = case["raw"].replace("{BIG}", "a" * 20000).replace("{MANY}", "X-H: v\r\n" * 300)
        out = raw_exchange(stack.server.port, raw.encode("latin-1"))
        head, _, body = out.partition(b"\r\n\r\n")
        status = int(head.split(b" ")[1])
        assert_error_shape(status, body)
        return
    body = bytes.fromhex(case["body_hex"]) if "body_hex" in case else case["body"].encode()
    headers = dict(case.get("headers", {}))
    sent = body
    if "encode" in case:
        sent = gzip.compress(body) if case["encode"] == "gzip" else zlib.compress(body)
        headers["Content-Encoding"] = case["encode"]
    before = len(stack.engine.seen)
    status, resp, seen = post_bytes(client, stack, sent, case.get("path", "/v1/completions"), headers=headers)
    if case["expect"] == "reject":
        err = assert_error_shape(status, resp)
        assert seen is None
        assert status == case.get("status", status) and err["code"] == case.get("code", err["code"])
    else:
        assert status == 200, resp[:300]
        assert seen == body  # the engine got the very bytes the client sent (decoded when encoded)
        assert "Content-Encoding" not in stack.engine.seen[before][1]


def test_deep_nesting_and_huge_bodies(stack: Stack, client: httpx.Client) -> None:
    for depth in (2000, 100_000):
        body = b'{"model": "fake-model", "prompt": "x", "deep": ' + b"[" * depth + b"]" * depth + b"}"
        status, resp, seen = post_bytes(client, stack, body)
        assert_error_shape(status, resp)
        assert seen is None
    big = b'{"model": "fake-model", "prompt": "' + b"a" * (50 * 2**20) + b'"}'
    status, resp, _ = post_bytes(client, stack, big)  # 50 MB with Content-Length
    assert status == 413 and assert_error_shape(status, resp)["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:  # 50 MB streamed without a Content-Length
        yield big[:1024]
        for i in range(1024, len(big), 1 << 20):
            yield big[i: i + (1 << 20)]

    r = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert_error_shape(r.status_code, r.content)


def _gzip_bomb(decoded_bytes: int) -> bytes:
    """A gzip body of ``decoded_bytes`` bytes of JSON that compresses ~1000:1."""
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    parts = [z.compress(b'{"model": "fake-model", "prompt": "')]
    block = b"a" * 2**20
    parts.extend(z.compress(block) for _ in range(decoded_bytes // len(block)))
    parts.append(z.compress(b'"}') + z.flush())
    return b"".join(parts)


def test_compressed_requests_cannot_open_the_breaker(stack: Stack, client: httpx.Client) -> None:
    """Before the fix a gzip body went upstream still marked gzip, the engine answered 500 and
    five such requests opened the replica's breaker: every caller then got 503."""
    plain = b'{"model": "fake-model", "prompt": "gzip me"}'
    for _ in range(8):
        status, resp, seen = post_bytes(client, stack, gzip.compress(plain), headers={"Content-Encoding": "gzip"})
        assert status == 200 and seen == plain, resp[:300]
        status, resp, seen = post_bytes(client, stack, b"\x1f\x8b not gzip", headers={"Content-Encoding": "gzip"})
        assert status == 400 and seen is None
    assert stack.server.state.proxy.breakers.states().get("e0", "closed") == "closed"
    status, resp, _ = post_bytes(client, stack, plain)
    assert status == 200, resp[:300]


def test_gzip_bomb_is_refused(stack: Stack, client: httpx.Client) -> None:
    bomb = _gzip_bomb(64 * 2**20)  # 64 MiB once decoded (limit 4 MiB), ~64 KB on the wire
    assert len(bomb) < 1 * 2**20
    status, resp, seen = post_bytes(client, stack, bomb, headers={"Content-Encoding": "gzip"})
    assert status == 413 and assert_error_shape(status, resp)["code"] == "body_too_large"
    assert seen is None


def test_ten_thousand_messages_pass_through(stack: Stack, client: httpx.Client) -> None:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(10_000)]
    body = orjson.dumps({"model": MODEL, "messages": msgs})
    status, _, seen = post_bytes(client, stack, body, "/v1/chat/completions")
    assert status == 200 and seen == body


def test_invalid_header_values_are_client_errors(stack: Stack, client: httpx.Client) -> None:
    body = b'{"model": "fake-model", "prompt": "x"}'
    for headers in ({"Authorization": "Bearer \x7f\x01"}, {"X-Request-Id": "\x01" * 500},
                    {"X-Session-Id": "s" * 8000}, {"Content-Type": "text/plain; charset=bogus"}):
        status, resp, seen = post_bytes(client, stack, body, headers=headers)
        assert status < 500, (headers, resp)
        if status >= 400:
            assert_error_shape(status, resp)


JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | \
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda kids: st.lists(kids, max_size=5) |
                           st.dictionaries(st.text(max_size=10), kids, max_size=5), max_leaves=25)
KNOWN = ("prompt", "messages", "max_tokens", "stream", "stream_options", "user", "cache_salt", "tools",
         "chat_template_kwargs", "add_generation_prompt", "n", "temperature", "logprobs")


@FUZZ
@given(body=st.binary(max_size=3000))
def test_fuzz_arbitrary_bytes(body: bytes, stack: Stack, client: httpx.Client) -> None:
    status, resp, seen = post_bytes(client, stack, body)
    if status >= 400:
        assert_error_shape(status, resp)
        assert seen is None
    else:
        assert status == 200 and seen == body


@FUZZ
@given(extra=st.dictionaries(st.text(max_size=12).filter(lambda k: k != "model"), JSON_VALUES, max_size=6),
       chat=st.booleans())
def test_fuzz_unknown_fields_pass_through_untouched(extra: dict[str, Any], chat: bool, stack: Stack,
                                                    client: httpx.Client) -> None:
    body = orjson.dumps({"model": MODEL, **extra})
    status, resp, seen = post_bytes(client, stack, body, "/v1/chat/completions" if chat else "/v1/completions")
    assert status == 200, resp[:300]
    assert seen == body


@FUZZ
@given(fields=st.dictionaries(st.sampled_from(KNOWN), JSON_VALUES, min_size=1, max_size=6),
       chat=st.booleans(), spaces=st.booleans())
def test_fuzz_known_fields_of_any_type(fields: dict[str, Any], chat: bool, spaces: bool, stack: Stack,
                                       client: httpx.Client) -> None:
    body = orjson.dumps({"model": MODEL, **fields})
    if spaces:
        body = json.dumps(json.loads(body), indent=1).encode()
    status, resp, seen = post_bytes(client, stack, body, "/v1/chat/completions" if chat else "/v1/completions")
    assert status == 200, resp[:300]
    assert seen == body


@FUZZ
@given(model=JSON_VALUES)
def test_fuzz_model_field(model: Any, stack: Stack, client: httpx.Client) -> None:
    body = orjson.dumps({"model": model, "prompt": "x"})
    status, resp, seen = post_bytes(client, stack, body)
    if model == MODEL or model is None:
        assert status == 200 and seen == body
    else:
        assert_error_shape(status, resp)
        assert seen is None


def test_router_survived_and_memory_is_bounded(stack: Stack, tmp_path: Path) -> None:
    """A separate router process takes the heaviest inputs; its peak RSS stays bounded and its
    RSS flat over repetitions."""
    cfg = router_config([stack.engine], policy={"name": "cache_aware"},
                        models={MODEL: {"tokenizer": "builtin", "block_size": 16}}).to_dict()
    cfg["listen"]["port"] = port = _free()
    path = tmp_path / "router.yaml"
    path.write_text(json.dumps(cfg))
    proc = Proc(kvrouter_argv("serve", "--config", str(path)), ready_url=f"http://127.0.0.1:{port}/health").start()
    try:
        assert proc.proc is not None
        pid = proc.proc.pid
        msgs = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"m{i}"}
                                                          for i in range(10_000)]})
        big = b'{"model": "fake-model", "prompt": "' + b"a" * (50 * 2**20) + b'"}'
        deep = b'{"model": "fake-model", "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        bomb = _gzip_bomb(1 << 30)  # 1 GiB once decoded: refused at the 16 MiB limit, memory bounded
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            rss = []
            for _ in range(6):
                r = c.post("/v1/chat/completions", content=msgs)
                assert r.status_code == 200, r.text[:300]
                assert c.post("/v1/completions", content=big).status_code == 413
                assert c.post("/v1/completions", content=deep).status_code == 400
                assert c.post("/v1/completions", content=bomb, headers={"Content-Encoding": "gzip"}).status_code == 413
                rss.append(_status(pid, "VmRSS"))
            assert c.get("/health").status_code == 200
        peak = _status(pid, "VmHWM")
        assert peak < 400 * 2**20, f"peak RSS {peak / 2**20:.0f} MiB"
        assert rss[-1] <= rss[1] + 40 * 2**20, [r // 2**20 for r in rss]
    finally:
        proc.stop()


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(key)


def _free() -> int:
    from tests.support.services import free_port

    return free_port()


def test_config_types() -> None:
    assert Config.from_dict({}).limits.max_body_bytes == 16 * 2**20


async def test_an_unhandled_error_is_a_500_in_openai_shape_without_traceback() -> None:
    from aiohttp import web

    from router.conn import GuardedRunner
    from tests.support.services import free_port

    async def boom(request: web.Request) -> web.Response:
        raise RuntimeError("secret internal detail")

    app = web.Application()
    app.router.add_get("/boom", boom)
    runner = GuardedRunner(app, max_connections=10)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with httpx.AsyncClient() as c:
            r = await c.get(f"http://127.0.0.1:{port}/boom", headers={"Accept": "text/html"})
        assert r.status_code == 500
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "internal_error"
        assert "secret" not in r.text and "Traceback" not in r.text
    finally:
        await runner.cleanup()


def test_admin_and_debug_endpoints_take_compressed_bodies(stack: Stack, client: httpx.Client) -> None:
    """/debug/route and POST /admin/replicas read their bodies as the proxy does: a gzip or
    deflate body is decoded (before the fix: 400 invalid_json), a broken one is a 4xx error."""
    route = orjson.dumps({"model": MODEL, "prompt": "x" * 64})
    for enc, data in (("gzip", gzip.compress(route)), ("deflate", zlib.compress(route))):
        r = client.post("/debug/route", content=data, headers={"Content-Encoding": enc, **AUTH})
        assert r.status_code == 200, r.text
        assert r.json()["replicas"][0]["id"] == "e0"
    r = client.post("/debug/route", content=b"\x1f\x8b broken", headers={"Content-Encoding": "gzip", **AUTH})
    assert assert_error_shape(r.status_code, r.content)["param"] == "Content-Encoding"
    rep = orjson.dumps({"id": "gz-replica", "url": "http://127.0.0.1:9", "models": [MODEL]})
    r = client.post("/admin/replicas", content=gzip.compress(rep), headers={"Content-Encoding": "gzip", **AUTH})
    try:
        assert r.status_code == 201, r.text
        assert "gz-replica" in {x["id"] for x in client.get("/admin/replicas", headers=AUTH).json()["replicas"]}
    finally:
        client.delete("/admin/replicas/gz-replica", headers=AUTH)
    r = client.post("/admin/replicas", content=b"not deflate", headers={"Content-Encoding": "deflate", **AUTH})
    assert_error_shape(r.status_code, r.content)
