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

:class:`Response` and the errors live in :mod:`router.upstream_response` (re-exported here).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Iterable
from urllib.parse import urlsplit

from router.upstream_response import (  # noqa: F401  (re-exported)
    BadResponse,
    ConnectFailed,
    Response,
    UpstreamClosed,
    UpstreamError,
    _expire,
)

_MAX_HEAD = 65536
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection"})
# not kept in Response.headers (hop-by-hop, or set again by the router's own server)
_NOT_FORWARDED = frozenset({"keep-alive", "proxy-authenticate", "proxy-connection", "te", "trailer", "trailers",
                            "upgrade", "date", "server"})
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
