"""router.upstream, the router's HTTP/1.1 client, against raw socket servers that send
exactly the bytes a test wants: framing (length, chunked split anywhere, until close),
keep-alive reuse, stale pooled connections, and breaks mid-body."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from router.upstream import ConnectFailed, UpstreamClosed, UpstreamPool
from tests.support.services import free_port

Reply = Callable[[bytes, asyncio.StreamWriter], "asyncio.Future[None] | None"]


class RawServer:
    """Reads one request head+body at a time and answers with ``script(n)`` pieces."""

    def __init__(self, script: Callable[[int], list[bytes | float | None]]) -> None:
        self.script = script
        self.requests: list[bytes] = []
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                for piece in self.script(len(self.requests)):
                    if piece is None:  # close now
                        writer.close()
                        return
                    if isinstance(piece, float):
                        await asyncio.sleep(piece)
                        continue
                    writer.write(piece)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"a\": true}"


async def test_content_length_and_keep_alive_reuse():
    async with RawServer(lambda n: [OK]) as srv:
        pool = UpstreamPool()
        for _ in range(3):
            r = await pool.request(srv.url, "POST", "/v1/x?q=1", [("X-Request-Id", "r1")], b"hello")
            assert r.status == 200 and r.content_type == "application/json"
            assert await r.read() == b'{"a": true}'
            r.release()
        assert srv.connections == 1  # one pooled connection, reused
        first = srv.requests[0]
        assert first.startswith(b"POST /v1/x?q=1 HTTP/1.1\r\n") and first.endswith(b"\r\n\r\nhello")
        assert b"Content-Length: 5\r\n" in first and b"X-Request-Id: r1\r\n" in first
        pool.close()


async def test_chunked_split_at_every_byte():
    body = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"6;ext=1\r\ndata: \r\na\r\n{\"x\": 1}\n\n\r\n0\r\nTrailer: x\r\n\r\n")
    pieces: list[bytes | float | None] = []
    for i in range(len(body)):
        pieces += [body[i:i + 1], 0.0]
    async with RawServer(lambda n: pieces) as srv:
        pool = UpstreamPool()
        r = await pool.request(srv.url, "POST", "/", [], b"")
        got = b""
        while chunk := await r.readany():
            got += chunk
        assert got == b'data: {"x": 1}\n\n'
        assert r.complete
        r.release()
        r2 = await pool.request(srv.url, "POST", "/", [], b"")  # reused after a complete chunked body
        await r2.read()
        r2.release()
        assert srv.connections == 1
        pool.close()


async def test_body_until_close_and_connection_close_not_reused():
    reply = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it"
    async with RawServer(lambda n: [reply, None]) as srv:
        pool = UpstreamPool()
        for _ in range(2):
            r = await pool.request(srv.url, "POST", "/", [], b"")
            assert await r.read() == b"all of it"
            r.release()
        assert srv.connections == 2
        pool.close()


async def test_stale_pooled_connection_is_retried_once_transparently():
    # the server answers, then closes the idle connection (as uvicorn does after its keep-alive timeout)
    async with RawServer(lambda n: [OK, 0.05, None]) as srv:
        pool = UpstreamPool()
        r = await pool.request(srv.url, "POST", "/", [], b"")
        await r.read()
        r.release()
        await asyncio.sleep(0.2)
        r = await pool.request(srv.url, "POST", "/", [], b"")
        assert await r.read() == b'{"a": true}'
        r.release()
        assert srv.connections == 2
        pool.close()


async def test_break_mid_body_raises_and_closes():
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part"
    async with RawServer(lambda n: [reply, None]) as srv:
        pool = UpstreamPool()
        r = await pool.request(srv.url, "POST", "/", [], b"")
        with pytest.raises(UpstreamClosed):
            await r.read()
        r.release()
        pool.close()


async def test_close_before_head_and_refused():
    async with RawServer(lambda n: [None]) as srv:
        pool = UpstreamPool()
        with pytest.raises(UpstreamClosed):
            await pool.request(srv.url, "POST", "/", [], b"")
    with pytest.raises(ConnectFailed):
        await UpstreamPool(connect_timeout=2).request(f"http://127.0.0.1:{free_port()}", "POST", "/", [], b"")


async def test_abandoned_response_closes_the_connection():
    reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"
    async with RawServer(lambda n: [reply, 5.0]) as srv:
        pool = UpstreamPool()
        r = await pool.request(srv.url, "POST", "/", [], b"")
        assert await r.readany() == b"abc"
        conn = r.conn
        r.release()  # the client went away mid-body: the upstream connection must close
        assert conn.closed
        pool.close()


async def test_retire_closes_idle_now_and_busy_after_their_response():
    async with RawServer(lambda n: [OK]) as srv:
        pool = UpstreamPool()
        idle = await pool.request(srv.url, "POST", "/", [], b"")
        await idle.read()
        busy = await pool.request(srv.url, "POST", "/", [], b"")  # a second connection, still held
        idle.release()
        idle_conn, busy_conn = idle.conn, busy.conn
        pool.retire(srv.url)
        assert idle_conn.closed and not busy_conn.closed  # the in-flight one is not cut
        assert await busy.read() == b'{"a": true}'
        busy.release()
        assert busy_conn.closed  # not put back for reuse
        pool.close()
