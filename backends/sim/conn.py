"""Connection-level error handling of the simulated engine's listener, and its serve loop.

aiohttp answers a protocol-level error (a malformed request line, an HTTP/2 preface such as
sglang-router's probes, an invalid header, a bad chunked body) with a text/plain 400 and logs
the parser's traceback at ERROR. :class:`SimRequestHandler` answers it in OpenAI's error shape
(as :func:`backends.sim.api.error_body`) and logs one line (INFO, no traceback); a 5xx keeps
its traceback in the log, never in the response. :func:`serve` runs an application on a
:class:`SimRunner` (an ``AppRunner`` whose connections use that handler) until SIGINT or
SIGTERM. The same technique as the router's ``router.conn`` (backends may not import
``router`` outside ``router.core``), checked against aiohttp 3.9–3.14.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from backends.sim.api import error_body

log = logging.getLogger("kvrouter.sim")


def protocol_error_response(status: int, message: str | None) -> web.Response:
    """The JSON response to a request the HTTP parser rejected (or a 5xx outside any handler)."""
    if status >= 500:
        text = "internal error of the simulated engine"
    else:
        try:
            text = message or HTTPStatus(status).phrase
        except ValueError:
            text = "bad request"
        text = "".join(ch if ch.isprintable() else "?" for ch in str(text))[:300]
    resp = web.Response(status=status, body=orjson.dumps(error_body(status, f"Malformed HTTP request: {text}"
                                                                    if status < 500 else text)),
                        content_type="application/json")
    resp.force_close()
    return resp


class SimRequestHandler(RequestHandler):
    """A RequestHandler whose protocol errors are OpenAI-shaped and logged without a traceback."""

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        remote = getattr(request, "remote", "?")
        if status >= 500:
            log.error("error handling request from %s", remote, exc_info=exc)
        else:
            log.info("malformed HTTP request from %s: %s", remote, str(message or exc or status)[:200])
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        return protocol_error_response(status, message)


class SimHTTPServer(web.Server):
    """``web.Server`` building :class:`SimRequestHandler` connections."""

    def __call__(self) -> RequestHandler:
        return SimRequestHandler(self, loop=self._loop, **self._kwargs)


class SimRunner(web.AppRunner):
    """An AppRunner whose server is a :class:`SimHTTPServer`."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = SimHTTPServer
        return server


async def serve(app: web.Application, host: str, port: int) -> None:
    """Serve ``app`` on ``host:port`` until SIGINT or SIGTERM, then clean up (as ``web.run_app``)."""
    runner = SimRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, host, port).start()
        await stop.wait()
    finally:
        await runner.cleanup()
