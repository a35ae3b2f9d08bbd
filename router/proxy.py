"""The upstream side of the router: choose a replica, send the client's bytes, stream back.

Upstream connections are kept alive per replica by :mod:`router.upstream`. For each
request: the policy chooses a replica, an in-flight :class:`~router.pool.Guard` is taken
and held until the response's last byte is written (or the request fails or the client
goes away), and the original body bytes are sent unchanged.

Failures: a connect failure, a 5xx or a 429 *before the first byte reaches the client* is
retried on another replica (bounded, exponential backoff); a connect failure also ejects
the replica at once (see ``health.eject_on_connect_error``). Streams are held back until
their first upstream chunk arrives, so an engine that dies before producing anything is
retried too. Once bytes have reached the client, an upstream failure ends the stream with
an OpenAI-style error event and ``data: [DONE]``. Streams are forwarded on SSE event
boundaries so that such an error event never lands inside a half-written event.

Timeouts: connect, first byte, idle between chunks and total (``upstream.*``). Client
disconnects cancel the handler task (aiohttp ``handler_cancellation``), which closes the
upstream connection at once; the engine sees the disconnect and aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from aiohttp import web

from router.config import Config
from router.core.types import Decision, NoReplicaError, RoutingRequest
from router.metrics import RouterMetrics
from router.pool import Guard, Pool, Replica
from router.protect import breaker_outcome, build_breakers, deferred_outcome, maybe_request_fault
from router.upstream import ConnectFailed, Response, UpstreamError, UpstreamPool

# never forwarded, in either direction (RFC 9110 §7.6.1 plus framing we recompute)
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
    "expect",
})
# also not forwarded upstream: we ask the engine for identity encoding (so streams can be
# cut on event boundaries) and handle client auth ourselves; the body sent is always plain
# (a compressed request body is decoded by the server: router/body_encoding.py)
REQUEST_DROP = HOP_BY_HOP | {"accept-encoding", "content-encoding"}

_DONE = b"data: [DONE]\n\n"
_TAIL = 8192  # bytes of a stream kept to read the final usage chunk


class PrefixService(Protocol):
    """See /tmp seams: the prefix-routing engineer's ``router.prefix`` implements this."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def annotate(self, path: str, body: Mapping[str, Any], req: RoutingRequest) -> None: ...
    async def lookup(self, req: RoutingRequest) -> dict[str, int]: ...
    def record(self, req: RoutingRequest, replica: str) -> None: ...
    def observe(self, req: RoutingRequest, decision: Decision, cached_tokens: int | None) -> None: ...
    def replica_removed(self, replica: str) -> None: ...


class NullPrefixService:
    """No tokenization, no index: what the router uses when no prefix service is built."""

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def annotate(self, path: str, body: Mapping[str, Any], req: RoutingRequest) -> None:
        return None

    async def lookup(self, req: RoutingRequest) -> dict[str, int]:
        return {}

    def record(self, req: RoutingRequest, replica: str) -> None:
        return None

    def observe(self, req: RoutingRequest, decision: Decision, cached_tokens: int | None) -> None:
        return None

    def replica_removed(self, replica: str) -> None:
        return None


def error_body(message: str, type_: str, code: str | int | None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def error_response(status: int, message: str, type_: str, code: str | int | None,
                   headers: Mapping[str, str] | None = None, param: str | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(message, type_, code, param),
                        content_type="application/json", headers=headers)


@dataclass(slots=True)
class RequestContext:
    """Everything the proxy needs about one client request (built by the server)."""

    method: str
    path_qs: str
    body: bytes
    parsed: Mapping[str, Any]
    model: str
    request_id: str
    session_key: str | None
    t0: float
    upstream_headers: dict[str, str]
    replica: str = ""
    reason: str = ""
    status: int = 0
    first_byte_at: float | None = None
    attempts: int = 0
    stream: web.StreamResponse | None = None


@dataclass(slots=True)
class _Retry:
    reason: str
    status: int = 502
    body: bytes = b""
    headers: list[tuple[str, str]] | None = None


class Proxy:
    """Routes and forwards requests for one app."""

    def __init__(self, config: Config, pool: Pool, policy: Any, prefix: PrefixService,
                 metrics: RouterMetrics, rng: random.Random, log: logging.Logger) -> None:
        self.cfg = config.upstream
        self.pool = pool
        self.policy = policy
        self.policy_name = getattr(policy, "name", config.policy.name)
        self.needs_prefix = bool(getattr(policy, "needs_prefix", False))
        self._on_routed = getattr(policy, "on_routed", None)
        self._on_finished = getattr(policy, "on_finished", None)
        self.prefix = prefix
        self.metrics = metrics
        self.rng = rng
        self.log = log
        self.replica_header = config.headers.replica_header
        self.request_id_header = config.headers.request_id_header
        self.upstream: UpstreamPool | None = None
        self.write_timeout = config.limits.client_write_timeout_s  # a client not reading is cut off
        self.breakers = build_breakers(config.breaker, metrics.registry, log)  # router/breaker.py

    async def start(self) -> None:
        self.upstream = UpstreamPool(self.cfg.max_connections_per_replica, self.cfg.connect_timeout_s)

    async def close(self) -> None:
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = None

    def retire_upstream(self, url: str) -> None:
        """A replica left the pool: drop its connection pool (in-flight requests finish)."""
        if self.upstream is not None:
            self.upstream.retire(url)

    # ------------------------------------------------------------------ the request path

    async def forward(self, request: web.Request, ctx: RequestContext) -> web.StreamResponse:
        try:
            async with asyncio.timeout(self.cfg.total_timeout_s):
                return await self._forward(request, ctx)
        except TimeoutError:
            return await self._fail_late(request, ctx, 504, "upstream request exceeded the total timeout",
                                         "timeout", "upstream_timeout")

    async def _forward(self, request: web.Request, ctx: RequestContext) -> web.StreamResponse:
        rreq = RoutingRequest(model=ctx.model, session_key=ctx.session_key, request_id=ctx.request_id)
        matches: Mapping[str, int] = {}
        if self.needs_prefix:
            await self.prefix.annotate(ctx.path_qs, ctx.parsed, rreq)
            matches = await self.prefix.lookup(rreq)
        deferred: list[str] = []  # replicas whose 5xx verdict waits for the request's end
        try:
            return await self._route_loop(request, ctx, rreq, matches, deferred)
        finally:
            if deferred:
                verdict = deferred_outcome(ctx.status)
                now = asyncio.get_running_loop().time()
                for rid in deferred:
                    self.breakers.finished(rid, verdict, now)

    async def _route_loop(self, request: web.Request, ctx: RequestContext, rreq: RoutingRequest,
                          matches: Mapping[str, int], deferred: list[str]) -> web.StreamResponse:
        last: _Retry | None = None
        while True:
            blocked = self.breakers.blocked(asyncio.get_running_loop().time())
            if blocked:  # open circuit breakers: skipped like ejected replicas
                rreq.exclude = rreq.exclude | blocked
            try:
                decision = self.policy.choose(rreq, self.pool.snapshot(ctx.model), matches, self.rng)
            except NoReplicaError as exc:
                return self._exhausted(ctx, last, str(exc))
            rep = self.pool.get(decision.replica)
            if rep is None:  # removed between snapshot and now
                rreq.exclude = rreq.exclude | {decision.replica}
                continue
            ctx.replica, ctx.reason = rep.cfg.id, decision.reason
            self.metrics.decision(self.policy_name, decision.reason)
            if self.needs_prefix:
                self.prefix.record(rreq, rep.cfg.id)
            if self._on_routed is not None:
                self._on_routed(rreq, decision)
            guard = Guard(rep.state)
            self.breakers.started(rep.cfg.id, asyncio.get_running_loop().time())
            outcome: bool | None = None
            defer = False
            try:
                out = await self._attempt(request, ctx, rep, rreq, decision)
                retried = isinstance(out, _Retry)
                outcome = breaker_outcome(out.status if retried else ctx.status, retried)
                # an engine's 500 may be the request's fault: judged once the request ends
                defer = isinstance(out, _Retry) and out.headers is not None and maybe_request_fault(out.status)
            finally:
                guard.release()
                if defer:
                    deferred.append(rep.cfg.id)
                else:
                    self.breakers.finished(rep.cfg.id, outcome, asyncio.get_running_loop().time())
            if self._on_finished is not None:
                self._on_finished(rreq, rep.cfg.id, not isinstance(out, _Retry) and ctx.status < 500)
            if not isinstance(out, _Retry):
                return out
            last = out
            if ctx.attempts > self.cfg.max_retries:
                return self._exhausted(ctx, last, "")
            self.metrics.retry(ctx.model, out.reason)
            rreq.exclude = rreq.exclude | {rep.cfg.id}
            backoff = min(self.cfg.retry_backoff_max_s, self.cfg.retry_backoff_s * (2 ** (ctx.attempts - 1)))
            self.log.debug("retrying %s after %s on %s", ctx.request_id, out.reason, rep.cfg.id)
            if backoff > 0:
                await asyncio.sleep(backoff)

    def _exhausted(self, ctx: RequestContext, last: _Retry | None, why: str) -> web.Response:
        if last is not None and last.body and last.headers is not None:
            # the engine's own error (5xx / 429) after every retry: hand it over as it was
            ctx.status = last.status
            return web.Response(status=last.status, body=last.body, headers=self._filter(last.headers, ctx))
        if last is not None:
            timed_out = last.status == 504
            ctx.status = 504 if timed_out else 502
            return error_response(ctx.status, f"upstream failed after {ctx.attempts} attempt(s): {last.reason}",
                                  "timeout" if timed_out else "upstream_error",
                                  "upstream_timeout" if timed_out else "upstream_unavailable",
                                  headers={self.request_id_header: ctx.request_id})
        ctx.status = 503
        return error_response(503, why or f"no healthy replica for model {ctx.model!r}", "service_unavailable",
                              "no_healthy_replica", headers={self.request_id_header: ctx.request_id,
                                                             "Retry-After": "1"})

    def _filter(self, headers: list[tuple[str, str]], ctx: RequestContext) -> dict[str, str]:
        out = dict(headers)  # router.upstream already left out hop-by-hop, framing, Date and Server
        out[self.request_id_header] = ctx.request_id
        if self.replica_header:
            out[self.replica_header] = ctx.replica
        return out

    async def _attempt(self, request: web.Request, ctx: RequestContext, rep: Replica,
                       rreq: RoutingRequest, decision: Decision) -> web.StreamResponse | _Retry:
        assert self.upstream is not None
        ctx.attempts += 1
        loop = asyncio.get_running_loop()
        if ctx.attempts == 1:
            self.metrics.router_overhead(loop.time() - ctx.t0)
        headers = ctx.upstream_headers
        if rep.auth_headers:
            headers = {**headers, **rep.auth_headers}
        rid = rep.cfg.id
        try:
            resp = await self.upstream.request(rep.cfg.url, ctx.method, ctx.path_qs, headers.items(), ctx.body,
                                               self.cfg.first_byte_timeout_s)
        except ConnectFailed as exc:
            self.pool.report_connect_error(rid, str(exc))
            self.metrics.upstream_error(rid, "connect")
            return _Retry("connect")
        except UpstreamError:
            self.metrics.upstream_error(rid, "disconnect")
            return _Retry("disconnect")
        except TimeoutError:  # nothing reached the client yet: retried on another replica
            self.metrics.upstream_error(rid, "first_byte_timeout")
            return _Retry("first_byte_timeout", 504)
        try:
            status = resp.status
            if status >= 500 or status == 429:
                try:
                    body = await resp.read(self.cfg.idle_timeout_s)
                except (UpstreamError, TimeoutError):
                    body = b""
                self.metrics.upstream_error(rid, f"http_{status}")
                return _Retry(f"http_{status}", status, body, resp.headers)
            if resp.content_type == "text/event-stream":
                return await self._stream(request, ctx, resp, rreq, decision, loop)
            try:
                body = await resp.read(self.cfg.idle_timeout_s)
            except TimeoutError:
                self.metrics.upstream_error(rid, "idle_timeout")
                ctx.status = 504
                return error_response(504, "upstream stalled (upstream.idle_timeout_s)", "timeout",
                                      "upstream_timeout", headers={self.request_id_header: ctx.request_id})
            except UpstreamError:
                self.metrics.upstream_error(rid, "disconnect")
                return _Retry("disconnect")
            ctx.status = status
            ctx.first_byte_at = loop.time()
            if self.needs_prefix and status == 200 and b'"cached_tokens"' in body:
                self.prefix.observe(rreq, decision, _cached_tokens_json(body))
            return web.Response(status=status, body=body, headers=self._filter(resp.headers, ctx))
        finally:
            resp.release()  # back to the pool when fully read; closes the connection otherwise

    async def _stream(self, request: web.Request, ctx: RequestContext, resp: Response,
                      rreq: RoutingRequest, decision: Decision,
                      loop: asyncio.AbstractEventLoop) -> web.StreamResponse | _Retry:
        rid = ctx.replica
        try:
            first = await resp.readany(self.cfg.first_byte_timeout_s)
        except TimeoutError:  # nothing reached the client yet: retried on another replica
            self.metrics.upstream_error(rid, "first_byte_timeout")
            return _Retry("first_byte_timeout", 504)
        except UpstreamError:
            self.metrics.upstream_error(rid, "disconnect")
            return _Retry("disconnect")
        if not first:
            self.metrics.upstream_error(rid, "empty_stream")
            return _Retry("empty_stream")
        out = web.StreamResponse(status=resp.status, headers=self._filter(resp.headers, ctx))
        ctx.status = resp.status
        await out.prepare(request)
        ctx.stream = out
        ctx.first_byte_at = loop.time()
        keep_tail = self.needs_prefix
        tail = b""
        pending = b""
        chunk = first
        done = False
        idle = self.cfg.idle_timeout_s
        try:
            while True:
                if pending:
                    chunk = pending + chunk
                    pending = b""
                if chunk.endswith(b"\n\n"):
                    send = chunk
                else:
                    send, pending = _split_events(chunk)
                if send:
                    if not await self._write(request, out, ctx, send):
                        return out
                    if keep_tail:
                        tail = (tail + send)[-_TAIL:]
                    if send.endswith(_DONE) or send.endswith(b"[DONE]\r\n\r\n"):
                        done = True
                try:
                    chunk = await resp.readany(idle)
                except TimeoutError:
                    self.metrics.upstream_error(rid, "idle_timeout")
                    await self._end_stream(request, out, ctx, pending, "upstream stalled mid-stream "
                                           "(upstream.idle_timeout_s)", "upstream_timeout", 504)
                    return out
                except UpstreamError as exc:
                    self.metrics.upstream_error(rid, "stream_broken")
                    await self._end_stream(request, out, ctx, pending,
                                           f"upstream failed mid-stream: {type(exc).__name__}", "upstream_error", 502)
                    return out
                if not chunk:
                    break
        except ConnectionResetError:
            ctx.status = 499  # client went away while we wrote
            return out
        if pending:
            if not await self._write(request, out, ctx, pending):
                return out
            if pending.rstrip().endswith(b"[DONE]"):
                done = True
        if not done:
            self.metrics.upstream_error(rid, "stream_truncated")
            # ``pending`` (a half event, already written): the error event gets its own separator
            await self._end_stream(request, out, ctx, pending, "upstream closed the stream before [DONE]",
                                   "upstream_error", 502)
            return out
        if not await self._write(request, out, ctx, None):
            return out
        if keep_tail and b'"cached_tokens"' in tail:
            self.prefix.observe(rreq, decision, _cached_tokens_sse(tail))
        return out

    async def _write(self, request: web.Request, out: web.StreamResponse, ctx: RequestContext,
                     data: bytes | None) -> bool:
        """Write ``data`` to a started stream (``None``: end it), bounded by
        ``limits.client_write_timeout_s``. False when the client is gone or stopped reading
        (status 499; a client that stopped reading is cut off so its slot is freed)."""
        try:
            async with asyncio.timeout(self.write_timeout):
                if data is None:
                    await out.write_eof()
                else:
                    await out.write(data)
            return True
        except ConnectionResetError:
            ctx.status = 499
        except TimeoutError:
            ctx.status = 499
            self.metrics.reject("client_write_timeout")
            if request.transport is not None:
                request.transport.abort()
        return False

    async def _end_stream(self, request: web.Request, out: web.StreamResponse, ctx: RequestContext,
                          pending: bytes, message: str, code: str, status: int) -> None:
        """End a started stream cleanly: an OpenAI error event, then ``data: [DONE]``."""
        ctx.status = status
        event = b"data: " + error_body(message, "upstream_error", code) + b"\n\n"
        if await self._write(request, out, ctx, (b"\n\n" if pending else b"") + event + _DONE):
            await self._write(request, out, ctx, None)

    async def _fail_late(self, request: web.Request, ctx: RequestContext, status: int, message: str,
                         type_: str, code: str) -> web.StreamResponse:
        if ctx.stream is not None:
            out = ctx.stream
            await self._end_stream(request, out, ctx, b"", message, code, status)
            return out
        ctx.status = status
        return error_response(status, message, type_, code, headers={self.request_id_header: ctx.request_id})


_MAX_PENDING = 65536


def _split_events(chunk: bytes) -> tuple[bytes, bytes]:
    """(complete SSE events, the unfinished rest). An oversized unfinished event is flushed
    as is rather than held back."""
    i = chunk.rfind(b"\n\n")
    if i >= 0:
        return chunk[: i + 2], chunk[i + 2 :]
    i = chunk.rfind(b"\r\n\r\n")
    if i >= 0:
        return chunk[: i + 4], chunk[i + 4 :]
    if len(chunk) > _MAX_PENDING:
        return chunk, b""
    return b"", chunk


def _cached_tokens_json(body: bytes) -> int | None:
    try:
        usage = orjson.loads(body).get("usage") or {}
        return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        return None


def _cached_tokens_sse(tail: bytes) -> int | None:
    """``cached_tokens`` of the last event carrying usage in a stream's tail."""
    for event in reversed(tail.split(b"\n\n")):
        if b'"cached_tokens"' in event and event.startswith(b"data: "):
            return _cached_tokens_json(event[6:])
    return None
