"""A small HTTP/1.1 client for the router's upstream requests: keep-alive connection pools per
replica on asyncio protocols.

Why not aiohttp's client: per proxied request it costs more CPU than the whole rest of the
router (request/response objects, header multidicts, tracing hooks, timers), and the router
needs none of that — it sends bytes it already has and forwards bytes it receives. This
client writes the request in one ``write`` and parses only what a proxy needs from the
response: status, headers (kept as pairs to forward), and framing (Content-Length, chunked,
or until close). Measured with ``loadtest/bench_proxy.py``.

Semantics the proxy relies on:
- :meth:`UpstreamPool.request` returns once the response head has arrived.
  :class:`ConnectFailed` means the replica could not be reached (nothing was sent);
  :class:`UpstreamClosed` means the connection ended before a complete response. A
  pooled connection that turns out to be stale (closed by the server while idle) is
  retried once on a fresh connection, transparently.
- :meth:`Response.read` returns the whole body; :meth:`Response.readany` the next bytes
  (``b""`` at the end of the body).
- :meth:`Response.release` returns the connection to the pool when the response was
  complete and keep-alive, and closes it otherwise — so a request abandoned midway
  (client gone, timeout) closes its upstream connection at once and the engine sees
  the disconnect.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

_MAX_HEAD = 65536
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection"})
# not kept in Response.headers (hop-by-hop, or set again by the router's own server)
_NOT_FORWARDED = frozenset({"keep-alive", "proxy-authenticate", "proxy-connection", "te", "trailer", "trailers",
                            "upgrade", "date", "server"})
_HIGH_WATER = 1 << 20  # pause reading from the engine beyond this much unread body
_CONN_OPTIONS = frozenset({"", "close", "keep-alive"})  # Connection tokens that name no header


def connection_named(values: Iterable[str]) -> set[str]:
    """The header names (lower case) that ``Connection`` header values list as hop-by-hop
    (RFC 9110 §7.6.1), besides ``close``/``keep-alive``; empty when there are none."""
    named: set[str] = set()
    for v in values:
        for tok in v.split(","):
            tok = tok.strip().lower()
            if tok not in _CONN_OPTIONS:
                named.add(tok)
    return named


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


class _Conn(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    __slots__ = ("transport", "pool", "buf", "head_waiter", "resp", "closed", "used", "paused", "exc")

    def __init__(self, pool: _HostPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.head_waiter: asyncio.Future[Response] | None = None
        self.resp: Response | None = None
        self.closed = False
        self.used = False
        self.paused = False
        self.exc: BaseException | None = None

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is not None:
            resp._feed(data)
            return
        self.buf += data
        if self.head_waiter is None:
            if self.buf:  # bytes while idle: protocol error; drop the connection
                self.close()
            return
        self._parse_head()

    def eof_received(self) -> bool | None:
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if self.head_waiter is not None and not self.head_waiter.done():
            self.head_waiter.set_exception(UpstreamClosed(
                f"connection closed before the response head ({exc or 'EOF'})"))
        if self.resp is not None:
            self.resp._eof_from_close(exc)

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        pass

    # -- internals
    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.close()

    def _parse_head(self) -> None:
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > _MAX_HEAD:
                self._fail_head(BadResponse("response head too large"))
            return
        head = bytes(buf[:end]).decode("latin-1")
        rest = bytes(buf[end + 4 :])
        self.buf = bytearray()
        lines = head.split("\r\n")
        status_line = lines[0]
        if not status_line.startswith("HTTP/1."):
            self._fail_head(BadResponse(f"not an HTTP/1.x response: {status_line[:40]!r}"))
            return
        try:
            status = int(status_line[9:12])
        except ValueError:
            self._fail_head(BadResponse(f"bad status line {status_line[:40]!r}"))
            return
        headers: list[tuple[str, str]] = []
        length = -1
        chunked = False
        keep_alive = status_line[7] == "1"  # HTTP/1.1 defaults to keep-alive
        content_type = ""
        conn_values: list[str] = []
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                continue
            value = value.strip()
            lname = name.lower()
            if lname not in _FRAMING:
                if lname not in _NOT_FORWARDED:
                    headers.append((name, value))
                if lname == "content-type":
                    content_type = value.split(";", 1)[0].strip().lower()
                continue
            if lname == "content-length":
                try:
                    length = int(value)
                except ValueError:
                    self._fail_head(BadResponse("bad Content-Length"))
                    return
            elif lname == "transfer-encoding":
                chunked = "chunked" in value.lower()
            elif lname == "connection":
                v = value.lower()
                if "close" in v:
                    keep_alive = False
                elif "keep-alive" in v:
                    keep_alive = True
                if v != "close" and v != "keep-alive":
                    conn_values.append(v)
        if conn_values and (named := connection_named(conn_values)):  # headers it names are hop-by-hop
            headers = [(n, v) for n, v in headers if n.lower() not in named]
        if status == 100:  # Expect: 100-continue is never sent, but be tolerant
            self.buf = bytearray(rest)
            if self.buf:
                self._parse_head()
            return
        if status in (204, 304) or 100 <= status < 200:
            length, chunked = 0, False
        if chunked:
            length = -1
        resp = Response(self, status, headers, content_type, length, chunked, keep_alive)
        self.resp = resp
        waiter, self.head_waiter = self.head_waiter, None
        if rest or length == 0:
            resp._feed(rest)
        if waiter is not None and not waiter.done():
            waiter.set_result(resp)

    def _fail_head(self, exc: BaseException) -> None:
        waiter, self.head_waiter = self.head_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.close()


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


class _HostPool:
    """Idle keep-alive connections to one replica, at most ``limit`` open at once."""

    def __init__(self, host: str, port: int, limit: int, connect_timeout: float,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.host = host
        self.port = port
        self.ssl = ssl_context
        self.connect_timeout = connect_timeout
        self.idle: deque[_Conn] = deque()
        self.all: set[_Conn] = set()
        self.retired = False
        self._slots = asyncio.Semaphore(limit)

    def _forget(self, conn: _Conn) -> None:
        self.all.discard(conn)
        try:
            self.idle.remove(conn)
        except ValueError:
            pass

    def _put(self, conn: _Conn) -> None:
        if self.retired:  # the replica left: no more reuse
            conn.close()
            return
        conn.used = True
        conn.buf = bytearray()
        self.idle.append(conn)

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: _Conn(self), self.host, self.port, ssl=self.ssl,
                                                       server_hostname=self.host if self.ssl else None)
        except TimeoutError:
            raise ConnectFailed(f"connect to {self.host}:{self.port} timed out") from None
        except OSError as exc:
            raise ConnectFailed(f"connect to {self.host}:{self.port}: {exc.strerror or exc}") from None
        self.all.add(conn)
        return conn

    async def request(self, data: bytes, timeout: float | None) -> Response:
        await self._slots.acquire()
        try:
            for _ in range(2):
                conn = None
                while self.idle:
                    c = self.idle.pop()  # most recently used: least likely to be stale
                    if not c.closed:
                        conn = c
                        break
                reused = conn is not None
                if conn is None:
                    conn = await self._connect()
                loop = asyncio.get_running_loop()
                fut: asyncio.Future[Response] = loop.create_future()
                conn.head_waiter = fut
                assert conn.transport is not None
                timer = loop.call_later(timeout, _expire, fut) if timeout is not None else None
                try:
                    conn.transport.write(data)
                    return await fut
                except UpstreamClosed:
                    conn.close()
                    if reused:
                        continue  # a stale idle connection: once more on a fresh one
                    raise
                except BaseException:
                    conn.close()  # cancelled, timed out or failed while waiting for the head
                    raise
                finally:
                    if timer is not None:
                        timer.cancel()
            raise UpstreamClosed("connection closed before the response head")
        except BaseException:
            self._slots.release()
            raise

    def close(self) -> None:
        for c in list(self.all):
            c.close()
        self.idle.clear()


class UpstreamPool:
    """Connection pools keyed by replica base URL (``http://host:port``)."""

    def __init__(self, limit_per_host: int = 1000, connect_timeout: float = 2.0) -> None:
        self.limit = limit_per_host
        self.connect_timeout = connect_timeout
        self._hosts: dict[str, _HostPool] = {}

    def _host(self, base_url: str) -> _HostPool:
        hp = self._hosts.get(base_url)
        if hp is None:
            u = urlsplit(base_url)
            tls = u.scheme == "https"
            hp = self._hosts[base_url] = _HostPool(u.hostname or "127.0.0.1", u.port or (443 if tls else 80),
                                                   self.limit, self.connect_timeout,
                                                   ssl.create_default_context() if tls else None)
        return hp

    async def request(self, base_url: str, method: str, path_qs: str, headers: Iterable[tuple[str, str]],
                      body: bytes, timeout: float | None = None) -> Response:
        """Send one request; returns when the response head arrived (TimeoutError after
        ``timeout`` seconds without it)."""
        hp = self._host(base_url)
        head = [f"{method} {path_qs} HTTP/1.1\r\nHost: {hp.host}:{hp.port}\r\nContent-Length: {len(body)}\r\n"]
        head.extend(f"{k}: {v}\r\n" for k, v in headers)
        head.append("\r\n")
        return await hp.request("".join(head).encode("utf-8", "surrogateescape") + body, timeout)

    def retire(self, base_url: str) -> None:
        """The replica at ``base_url`` left: close its idle connections now, and the busy
        ones as their responses finish (requests in flight are not cut)."""
        hp = self._hosts.pop(base_url, None)
        if hp is not None:
            hp.retired = True
            while hp.idle:
                hp.idle.pop().close()

    def close(self) -> None:
        for hp in self._hosts.values():
            hp.close()
        self._hosts.clear()
