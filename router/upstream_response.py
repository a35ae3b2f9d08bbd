"""The upstream client's response side: :class:`Response` (the body of an upstream answer,
fed by the connection protocol in :mod:`router.upstream`, read by the proxy with
``read``/``readany``, framing by Content-Length, chunked or until close) and the errors the
client raises. Split from :mod:`router.upstream`, which re-exports every name here; the two
share the connection's internals (``conn.pool``, ``conn.resp``) by design.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.upstream import _Conn

_HIGH_WATER = 1 << 20  # pause reading from the engine beyond this much unread body


class UpstreamError(Exception):
    pass


class ConnectFailed(UpstreamError):
    """The TCP connection could not be made (refused, unreachable, timeout)."""


class UpstreamClosed(UpstreamError):
    """The connection ended (or broke) before the response was complete."""


class BadResponse(UpstreamError):
    """The upstream sent something that is not HTTP/1.x."""


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class Response:
    """An upstream response whose head has arrived; the body is read with read/readany.

    ``headers`` are the response's end-to-end headers, ready to forward: framing
    (Content-Length, Transfer-Encoding, Connection), hop-by-hop ones (including those the
    ``Connection`` header names), Date and Server are left out."""

    __slots__ = ("conn", "status", "headers", "content_type", "_remaining", "_chunked", "_keep_alive",
                 "_chunks", "_size", "_done", "_error", "_waiter", "_cbuf", "_chunk_left", "_trailer",
                 "_released")

    def __init__(self, conn: _Conn, status: int, headers: list[tuple[str, str]], content_type: str,
                 length: int, chunked: bool, keep_alive: bool) -> None:
        self.conn = conn
        self.status = status
        self.headers = headers
        self.content_type = content_type
        self._remaining = length  # -1: until close (or chunked)
        self._chunked = chunked
        self._keep_alive = keep_alive and (chunked or length >= 0)
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._done = length == 0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._cbuf = b""
        self._chunk_left = 0
        self._trailer = False
        self._released = False

    # -- feeding (from the protocol)
    def _feed(self, data: bytes) -> None:
        if self._done:
            if data:  # bytes after the end of the body: do not reuse the connection
                self._keep_alive = False
            return
        if self._chunked:
            self._feed_chunked(data)
        elif self._remaining >= 0:
            if len(data) >= self._remaining:
                if len(data) > self._remaining:
                    self._keep_alive = False
                data = data[: self._remaining]
                self._remaining = 0
                self._done = True
            else:
                self._remaining -= len(data)
            if data:
                self._push(data)
        elif data:
            self._push(data)
        self._wake()

    def _feed_chunked(self, data: bytes) -> None:
        buf = self._cbuf + data if self._cbuf else data
        pos = 0
        n = len(buf)
        out = []
        while pos < n:
            if self._chunk_left > 0:
                take = min(self._chunk_left, n - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self._chunk_left -= take
                if self._chunk_left == 0:
                    self._chunk_left = -2  # expect CRLF after the data
                continue
            if self._chunk_left == -2:
                if n - pos < 2:
                    break
                pos += 2
                self._chunk_left = 0
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                if n - pos > 4096:
                    self._error = BadResponse("bad chunked encoding")
                    self._done = True
                    self.conn.close()
                    return
                break
            line = buf[pos:eol]
            pos = eol + 2
            if self._trailer:
                if not line:  # end of trailers: message complete
                    self._done = True
                    if pos < n:
                        self._keep_alive = False
                    break
                continue
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                self._error = BadResponse("bad chunk size")
                self._done = True
                self.conn.close()
                return
            if size == 0:
                self._trailer = True
            else:
                self._chunk_left = size
        self._cbuf = buf[pos:] if pos < n and not self._done else b""
        if out:
            self._push(out[0] if len(out) == 1 else b"".join(out))

    def _push(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > _HIGH_WATER and not self.conn.paused and self.conn.transport is not None:
            self.conn.paused = True
            self.conn.transport.pause_reading()

    def _eof_from_close(self, exc: BaseException | None) -> None:
        if not self._done:
            if self._remaining < 0 and not self._chunked:
                self._done = True  # body delimited by close
            else:
                self._error = UpstreamClosed(f"connection closed mid-body ({exc or 'EOF'})")
        self._keep_alive = False
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    # -- reading (from the proxy)
    async def _wait(self, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = fut = loop.create_future()
        if timeout is None:
            await fut
            return
        timer = loop.call_later(timeout, _expire, fut)
        try:
            await fut
        finally:
            timer.cancel()

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size = 0
        if self.conn.paused and self.conn.transport is not None and not self.conn.closed:
            self.conn.paused = False
            self.conn.transport.resume_reading()
        return data

    async def readany(self, timeout: float | None = None) -> bytes:
        """The next body bytes; ``b""`` once the body is complete. Raises UpstreamClosed
        when the connection broke before the body was complete, TimeoutError when nothing
        arrived for ``timeout`` seconds."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            await self._wait(timeout)
        return self._take()

    async def read(self, idle_timeout: float | None = None) -> bytes:
        """The whole body; TimeoutError when nothing arrived for ``idle_timeout`` seconds."""
        while not self._done:
            if self._error is not None:
                raise self._error
            await self._wait(idle_timeout)
        if self._error is not None:
            raise self._error
        return self._take() if self._chunks else b""

    @property
    def complete(self) -> bool:
        return self._done and self._error is None

    def release(self) -> None:
        """Return the connection to its pool when reusable, else close it. Idempotent."""
        if self._released:
            return
        self._released = True
        conn = self.conn
        conn.resp = None
        if self._done and self._error is None and self._keep_alive and not conn.closed:
            self._chunks.clear()
            conn.pool._put(conn)
        else:
            conn.close()
        conn.pool._slots.release()
