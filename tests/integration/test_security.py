"""Secrets and access, over real sockets: API keys compared in constant time and never logged
or exported; admin endpoints only with the admin key; no header, path or body field can make
the router connect to a host outside its pool (no SSRF); the shared Redis index behind a
password and TLS, and namespaced so two deployments can share one server."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import io
import logging
import subprocess
from pathlib import Path

import aiohttp
import orjson
import pytest

import router.server as server_mod
from router.config import LoggingConfig
from router.index.redis import RedisIndex
from router.logs import setup_logging
from tests.integration.test_router import FakeEngine, fleet, post, start_router
from tests.support.services import RedisServer, free_port

CLIENT_KEY = "sk-client-7f3a9c1e5b"
WRONG_KEY = "sk-wrong-0d8e2b4a6c"
ADMIN_KEY = "adm-key-91c4e7a2f0"
REPLICA_KEY = "rep-key-5e1b3d9f27"
BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 1}


async def _get(url: str, key: str | None = None, method: str = "GET",
               body: bytes | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.request(method, url, headers=headers, data=body) as r:
        return r.status, await r.read()


async def test_keys_are_compared_in_constant_time(monkeypatch):
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(server_mod.hmac, "compare_digest", spy)
    async with fleet({}) as engines, start_router(
            engines, auth={"api_keys": [CLIENT_KEY, "other-key"], "admin_key": ADMIN_KEY}) as router:
        assert (await post(router.url + "/v1/completions", BODY,
                           headers={"Authorization": f"Bearer {CLIENT_KEY}"}))[0] == 200
        assert (await post(router.url + "/v1/completions", BODY,
                           headers={"Authorization": f"Bearer {CLIENT_KEY[:-1]}"}))[0] == 401
        assert (await _get(router.url + "/admin/replicas", ADMIN_KEY))[0] == 200
    assert (CLIENT_KEY.encode(), CLIENT_KEY.encode()) in calls
    assert (CLIENT_KEY[:-1].encode(), CLIENT_KEY.encode()) in calls
    assert (ADMIN_KEY.encode(), ADMIN_KEY.encode()) in calls
    # and no early exit that would leak which key matched: every key is compared, also when
    # the first configured key matches (and no plain ``==`` or length check short-cuts it:
    # the wrong-length key above still reached compare_digest)
    assert sum(1 for a, _ in calls if a == CLIENT_KEY[:-1].encode()) == 2
    assert sum(1 for a, _ in calls if a == CLIENT_KEY.encode()) == 2


async def test_keys_never_in_logs_metrics_or_admin_output():
    stream = io.StringIO()
    logger = logging.getLogger("kvrouter")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    setup_logging(LoggingConfig(level="debug", format="json", requests=True), stream)
    try:
        async with fleet({}, {"mode": "http500"}) as engines:
            dead = FakeEngine("dead")  # never started: connection refused
            reps = [*engines, dead]
            async with start_router(
                    reps, auth={"api_keys": [CLIENT_KEY], "admin_key": ADMIN_KEY, "metrics_public": False},
                    logging={"requests": True, "level": "debug", "format": "json"},
                    replicas=[{"id": e.name, "url": e.url, "models": ["fake-model"], "api_key": REPLICA_KEY}
                              for e in reps]) as router:
                u = router.url + "/v1/completions"
                for key in (CLIENT_KEY, WRONG_KEY, ADMIN_KEY, None):
                    h = {"Authorization": f"Bearer {key}"} if key else {}
                    await post(u, BODY, headers=h)
                    await post(u, {**BODY, "stream": True}, headers=h)
                    await post(u, None, headers=h, raw=b"{not json")
                    for path in ("/admin/replicas", "/metrics", "/v1/models"):
                        await _get(router.url + path, key)
                status, admin = await _get(router.url + "/admin/replicas", ADMIN_KEY)
                assert status == 200
                status, metrics = await _get(router.url + "/metrics", ADMIN_KEY)
                assert status == 200 and b"kvrouter_requests_total" in metrics
                # engines get the replica's key, never the client's
                seen = [h.get("Authorization") for e in engines for _, h, _ in e.seen]
                assert seen and set(seen) == {f"Bearer {REPLICA_KEY}"}
        logs = stream.getvalue()
        assert '"request_id"' in logs and "ejected" in logs  # the logs did record these requests
        for secret in (CLIENT_KEY, WRONG_KEY, ADMIN_KEY, REPLICA_KEY):
            for where, text in (("logs", logs), ("metrics", metrics.decode()), ("admin", admin.decode())):
                assert secret not in text, f"{secret} found in {where}"
    finally:
        logger.handlers[:] = saved[0]
        logger.setLevel(saved[1])
        logger.propagate = saved[2]


async def test_admin_endpoints_need_the_admin_key():
    async with fleet({}) as engines, start_router(
            engines, auth={"api_keys": [CLIENT_KEY], "admin_key": ADMIN_KEY, "metrics_public": False}) as router:
        new = orjson.dumps({"id": "x", "url": engines[0].url, "models": ["fake-model"]})
        calls = [("GET", "/admin/replicas", None), ("POST", "/admin/replicas", new),
                 ("DELETE", "/admin/replicas/e0", None), ("GET", "/metrics", None)]
        for method, path, body in calls:
            for key in (None, CLIENT_KEY, WRONG_KEY, ADMIN_KEY[:-1], ADMIN_KEY.upper()):
                status, resp = await _get(router.url + path, key, method, body)
                assert status == 401, (method, path, key)
                assert orjson.loads(resp)["error"]["code"] == "invalid_api_key"
        assert [r.cfg.id for r in router.state.pool.replicas()] == ["e0"]  # nothing changed
        assert (await _get(router.url + "/admin/replicas", ADMIN_KEY, "POST", new))[0] == 201
        assert (await _get(router.url + "/admin/replicas/x", ADMIN_KEY, "DELETE"))[0] == 200
        assert (await _get(router.url + "/metrics", ADMIN_KEY))[0] == 200
    async with fleet({}) as engines, start_router(engines, auth={"api_keys": [CLIENT_KEY]}) as router:
        for key in (None, CLIENT_KEY):  # no admin key configured: the admin API is off
            status, resp = await _get(router.url + "/admin/replicas", key)
            assert status == 403 and orjson.loads(resp)["error"]["code"] == "admin_disabled"


async def _raw(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = b""
    with contextlib.suppress(Exception):
        out = await asyncio.wait_for(reader.read(65536), 10)
    writer.close()
    return out


async def test_no_header_path_or_body_field_reaches_a_host_outside_the_pool():
    evil = await FakeEngine("evil").start()
    try:
        async with fleet({}) as engines, start_router(engines) as router:
            legit = engines[0]
            evil_hp = f"127.0.0.1:{evil.port}"
            u = router.url + "/v1/completions"
            for headers in ({"Host": evil_hp}, {"X-Forwarded-Host": evil_hp}, {"Forwarded": f"host={evil_hp}"},
                            {"X-Original-URL": evil.url + "/v1/completions"}, {"X-Rewrite-URL": evil.url},
                            {"X-Kvrouter-Replica": evil.url}, {"X-Kvrouter-Replica": "evil"},
                            {"X-Session-Id": evil.url}, {"X-Forwarded-For": "127.0.0.1"}):
                assert (await post(u, BODY, headers=headers))[0] == 200
            for field in ("base_url", "api_base", "url", "endpoint", "host", "replica", "upstream"):
                assert (await post(u, {**BODY, field: evil.url}))[0] == 200
            assert (await post(u, {**BODY, "model": evil.url}))[0] == 404
            assert (await post(router.url + "/debug/route", {**BODY, "replica": evil.url}))[0] < 500
            for path in (f"//{evil_hp}/v1/completions", f"/v1/completions/..%2F..%2F@{evil_hp}",
                         f"/v1/@{evil_hp}/completions", f"/v1/completions?x=@{evil_hp}",
                         f"/v1/%2F%2F{evil_hp}/v1/completions", f"/v1/..;/{evil_hp}"):
                raw = orjson.dumps(BODY)
                await _raw(router.port, f"POST {path} HTTP/1.1\r\nHost: {evil_hp}\r\nContent-Type: "
                           f"application/json\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
            # absolute-form request target naming another host
            raw = orjson.dumps(BODY)
            await _raw(router.port, f"POST {evil.url}/v1/completions HTTP/1.1\r\nHost: {evil_hp}\r\n"
                       f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
            await _raw(router.port, f"CONNECT {evil_hp} HTTP/1.1\r\nHost: {evil_hp}\r\n\r\n".encode())
            assert evil.seen == []
            assert len(legit.seen) >= 17
    finally:
        await evil.stop()


# ---------------------------------------------------------------------- Redis


def _chain(seed: int, n: int) -> list[int]:
    return [(seed << 20) + i + 1 for i in range(n)]


async def _index(url: str, namespace: str) -> RedisIndex:
    idx = RedisIndex(url, namespace=namespace, ttl_s=60, default_capacity=1000)
    await idx.start()
    return idx


async def test_redis_namespaces_isolate_two_deployments():
    server = RedisServer(password="pw-1b7e").start()
    try:
        a = await _index(server.url, "deploy-a")
        b = await _index(server.url, "deploy-b")
        h = _chain(1, 4)
        await a.record("m", h, "r0")
        await a.flush()
        await b.record("m", _chain(2, 3), "r0")
        await b.flush()
        assert await a.lookup("m", h) == {"r0": 4}
        assert await b.lookup("m", h) == {}  # same model, same replica name, other deployment
        await b.clear("r0")
        assert await a.lookup("m", h) == {"r0": 4}
        import redis.asyncio as aioredis

        raw = aioredis.from_url(server.url)
        keys = [k.decode() async for k in raw.scan_iter(count=1000)]
        await raw.aclose()
        assert keys and all(k.startswith(("deploy-a:", "deploy-b:")) for k in keys)
        for idx in (a, b):
            await idx.close()
        # without the password nothing is read or written
        anon = await _index(server.url.replace(":pw-1b7e@", ""), "deploy-a")
        assert await anon.lookup("m", h) == {}
        await anon.record("m", _chain(3, 2), "r9")
        await anon.flush()
        await anon.close()
        check = await _index(server.url, "deploy-a")
        assert await check.lookup("m", _chain(3, 2)) == {}
        await check.close()
    finally:
        server.stop()


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                        "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"openssl cannot make a test certificate: {exc}")
    return cert, key


async def test_redis_over_tls_with_password(tls_files, monkeypatch):
    cert, key = tls_files
    tls_port = free_port()
    server = RedisServer(password="pw-tls", extra=["--tls-port", str(tls_port), "--tls-cert-file", str(cert),
                                                   "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                                                   "--tls-auth-clients", "no"])
    try:
        server.start()
    except RuntimeError as exc:
        pytest.skip(f"this redis-server has no TLS support: {exc}")
    try:
        url = f"rediss://:pw-tls@127.0.0.1:{tls_port}/0"
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trust the test CA (both Redis clients)
        idx = await _index(url, "tls")
        h = _chain(5, 3)
        await idx.record("m", h, "r1")
        await idx.flush()
        assert await idx.lookup("m", h) == {"r1": 3}
        await idx.close()
        monkeypatch.delenv("SSL_CERT_FILE")  # an untrusted certificate is refused
        untrusted = await _index(url, "tls")
        assert await untrusted.lookup("m", h) == {}
        await untrusted.close()
    finally:
        server.stop()
