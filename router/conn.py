"""Connection-level protection for the router's listener (the layer below the handlers).

:class:`GuardedRunner` is an ``aiohttp.web.AppRunner`` whose connections

* answer every protocol-level error (a malformed request line, an invalid or oversized
  header, a bad chunked body, ...) in OpenAI's error shape
  ``{"error": {"message", "type", "param", "code"}}`` instead of aiohttp's plain text,
  and never with a traceback;
* are refused beyond ``limits.max_connections`` open connections (503 in the same shape,
  then closed) so that a client opening connections without end cannot exhaust file
  descriptors;
* are closed when idle for ``limits.client_idle_timeout_s`` — including a connection that
  sends nothing, or sends its headers too slowly, after it opens (aiohttp's keep-alive
  timer starts when the connection is made).

It relies on aiohttp's ``Server``/``RequestHandler`` classes (checked against aiohttp 3.9–3.14).
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("kvrouter.conn")


def _error_bytes(status: int, message: str, code: str) -> bytes:
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})


class JsonErrorHandler(RequestHandler):
    """A RequestHandler whose protocol errors are OpenAI-shaped and whose count is capped."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        manager = self._manager
        limit = getattr(manager, "kv_max_connections", 0)
        if limit and manager is not None and len(manager.connections) >= limit:
            body = _error_bytes(503, f"Too many open connections (limits.max_connections={limit})",
                                "too_many_connections")
            head = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
            try:
                transport.write(head + body)  # type: ignore[attr-defined]
            finally:
                transport.close()
            counter = getattr(manager, "kv_on_refused", None)
            if counter is not None:
                counter()
            return
        super().connection_made(transport)

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:  # the traceback goes to the log, never to the client
            log.error("error handling request from %s", getattr(request, "remote", "?"), exc_info=exc)
        else:
            log.debug("bad request from %s: %s", getattr(request, "remote", "?"), message or exc)
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Error"
        text = message or phrase
        if status >= 500:
            text, code = "The router failed to handle the request", "internal_error"
        elif status == 413:
            code = "body_too_large"
        elif status in (431,):
            code = "headers_too_large"
        else:
            code = "bad_request"
        # the parser's message names the fault (e.g. "Got more than 8190 bytes when reading
        # Header value"); keep it short and printable
        text = "".join(ch if ch.isprintable() else "?" for ch in str(text))[:300]
        resp = web.Response(status=status, body=_error_bytes(status, text, code), content_type="application/json")
        resp.force_close()
        return resp


class GuardedServer(web.Server):
    """``web.Server`` that builds :class:`JsonErrorHandler` connections."""

    kv_max_connections = 0
    kv_on_refused: Any = None

    def __call__(self) -> RequestHandler:
        return JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """An AppRunner with the protections of the module docstring."""

    def __init__(self, app: web.Application, *, max_connections: int = 0,
                 on_refused: Any = None, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._kv_max_connections = max_connections
        self._kv_on_refused = on_refused

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = GuardedServer
        server.kv_max_connections = self._kv_max_connections  # type: ignore[attr-defined]
        server.kv_on_refused = self._kv_on_refused  # type: ignore[attr-defined]
        return server
