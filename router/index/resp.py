"""A lean Redis connection for the index's hot path: one pipelined RESP2 socket.

redis-py's asyncio client spends ~0.25 ms of CPU per call (stream readers, RESP3 parser,
retry wrappers) — most of the per-request budget. Lookups only ever send one ``EVALSHA``
and read back a flat array, so this module speaks exactly that much RESP2 over an
``asyncio.Protocol``: commands are written at once, replies resolve futures in FIFO order
(a timed-out caller's reply is read and discarded, so the stream stays in sync). Supports
``redis://`` and ``rediss://`` (TLS), ``user:password@`` (AUTH) and ``/db`` (SELECT).
Everything else (writes, admin) goes through redis-py.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from typing import Any
from urllib.parse import unquote, urlsplit


class RespError(Exception):
    """An error reply from the server (``-ERR ...``)."""


class _Incomplete(Exception):
    pass


def encode_command(args: tuple[bytes | str | int, ...]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n" % len(b))
        out.append(b)
        out.append(b"\r\n")
    return b"".join(out)


def parse_reply(buf: bytes | bytearray, pos: int) -> tuple[Any, int]:
    """One RESP2 reply from ``buf`` at ``pos`` → (value, next pos); raises _Incomplete."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    kind = buf[pos]
    line = bytes(buf[pos + 1: end])
    nxt = end + 2
    if kind == 0x24:  # $ bulk
        n = int(line)
        if n < 0:
            return None, nxt
        if len(buf) < nxt + n + 2:
            raise _Incomplete
        return bytes(buf[nxt: nxt + n]), nxt + n + 2
    if kind == 0x3A:  # : integer
        return int(line), nxt
    if kind == 0x2A:  # * array
        n = int(line)
        if n < 0:
            return None, nxt
        items = []
        for _ in range(n):
            v, nxt = parse_reply(buf, nxt)
            items.append(v)
        return items, nxt
    if kind == 0x2B:  # + simple string
        return line.decode(), nxt
    if kind == 0x2D:  # - error
        return RespError(line.decode(errors="replace")), nxt
    raise RespError(f"protocol error: unexpected reply type {chr(kind)!r}")


async def timed(fut: asyncio.Future[Any], timeout: float) -> Any:
    """Await a reply future with a deadline. A timer fails the future instead of
    ``asyncio.wait_for``, which on Python 3.11 can swallow a cancellation that races with
    the reply (the caller's task would then never stop)."""
    timer = asyncio.get_running_loop().call_later(timeout, _expire, fut)
    try:
        return await fut
    finally:
        timer.cancel()


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError("redis reply timed out"))


class RespConnection(asyncio.Protocol):
    """One connection; ``call()`` returns a future of the decoded reply."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._waiters: deque[asyncio.Future[Any]] = deque()
        self.closed = False

    @classmethod
    async def open(cls, url: str, timeout: float) -> RespConnection:
        u = urlsplit(url)
        if u.scheme not in ("redis", "rediss"):
            raise ValueError(f"unsupported Redis URL scheme {u.scheme!r}")
        ctx = ssl.create_default_context() if u.scheme == "rediss" else None
        loop = asyncio.get_running_loop()
        # asyncio.timeout, not asyncio.wait_for: on Python 3.11 wait_for swallows a cancellation
        # that races with the connection completing, and a cancelled writer/sync task would
        # then run on and its owner's ``await task`` on close would never return
        async with asyncio.timeout(timeout):
            _, conn = await loop.create_connection(cls, u.hostname or "127.0.0.1", u.port or 6379, ssl=ctx)
        try:
            if u.password is not None:
                auth = (unquote(u.username), unquote(u.password)) if u.username else (unquote(u.password),)
                await conn.checked(timeout, "AUTH", *auth)
            db = (u.path or "/").strip("/")
            if db and db != "0":
                await conn.checked(timeout, "SELECT", db)
        except BaseException:
            conn.close()
            raise
        return conn

    async def checked(self, timeout: float, *args: bytes | str | int) -> Any:
        async with asyncio.timeout(timeout):
            v = await self.call(*args)
        if isinstance(v, RespError):
            raise v
        return v

    def call(self, *args: bytes | str | int) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.closed or self.transport is None:
            fut.set_exception(ConnectionError("redis connection closed"))
            return fut
        self._waiters.append(fut)
        self.transport.write(encode_command(args))
        return fut

    def call_many(self, commands: list[bytes]) -> list[asyncio.Future[Any]]:
        """Send already-encoded commands in one write (a pipeline); one future per command."""
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[Any]] = [loop.create_future() for _ in commands]
        if self.closed or self.transport is None:
            for f in futs:
                f.set_exception(ConnectionError("redis connection closed"))
            return futs
        self._waiters.extend(futs)
        self.transport.write(b"".join(commands))
        return futs

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # -- protocol callbacks -----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        try:
            while pos < len(buf) and self._waiters:
                value, pos = parse_reply(buf, pos)
                fut = self._waiters.popleft()
                if not fut.done():
                    fut.set_result(value)
        except _Incomplete:
            pass
        except (ValueError, RespError) as exc:
            self._fail(ConnectionError(f"redis protocol error: {exc}"))
            self.close()
            return
        del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ConnectionError(f"redis connection lost: {exc}"))

    def _fail(self, exc: Exception) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(exc)
