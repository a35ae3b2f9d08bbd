"""The router's HTTP front: the aiohttp application, its endpoints, and how it is served.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` and any other
``POST /v1/*`` (routed on the body's ``model``), ``GET /v1/models``, ``GET /health``,
``GET /ready``, ``GET /metrics``, the admin API under ``/admin/`` (:mod:`router.admin`) and
``POST /debug/route`` (:mod:`router.debug_route`). Every error the
router itself produces is an OpenAI-style JSON error with a 4xx/5xx status.

The hot path parses the body once (orjson) to read ``model`` and the session ``user``, and
forwards the original bytes. Auth, limits and request ids are checked inline (no
middleware chain).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import random
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from router.body_encoding import BodyEncodingError, decode_body
from router.config import Config
from router.conn import GuardedRunner
from router.core.scheduler import default_registry
from router.logs import request_logger
from router.metrics import RouterMetrics
from router.pool import Pool
from router.protect import build_rate_limiter, refused_counter
from router.proxy import (
    REQUEST_DROP,
    NullPrefixService,
    PrefixService,
    Proxy,
    RequestContext,
    error_response,
)
from router.upstream import connection_named

log = logging.getLogger("kvrouter.server")
# compressed bodies larger than this are decoded in a worker thread: deflate expands at most
# ~1032:1, so an inline decode yields about 1 MiB at most (a few ms of the event loop)
_DECODE_INLINE = 1024


def build_prefix(config: Config, registry: CollectorRegistry, needs_prefix: bool) -> PrefixService:
    """The prefix engineer's service when the policy needs it and ``router.prefix`` exists."""
    if not needs_prefix:
        return NullPrefixService()
    import importlib.util

    if importlib.util.find_spec("router.prefix") is None:
        log.warning("policy %s needs prefix matching but router.prefix is not installed; "
                    "routing without prefix information", config.policy.name)
        return NullPrefixService()
    from router.prefix import build_prefix_service  # type: ignore[import-not-found]

    return build_prefix_service(config, registry)  # type: ignore[no-any-return]


class RouterState:
    """Everything one app instance owns: config, pool, policy, proxy, metrics."""

    def __init__(self, config: Config, *, prefix: PrefixService | None = None,
                 registry: CollectorRegistry | None = None, seed: int | None = None) -> None:
        self.config = config
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.policy = default_registry().create(config.policy.name, config.policy.options)
        needs_prefix = bool(getattr(self.policy, "needs_prefix", False))
        self.prefix = prefix if prefix is not None else build_prefix(config, self.registry, needs_prefix)
        self.metrics: RouterMetrics
        self.pool = Pool(config.replicas, config.health, config.scrape,
                         on_removed=self._replica_removed, on_health=self._health_changed,
                         on_left=lambda rc: self.proxy.retire_upstream(rc.url))
        self.metrics = RouterMetrics(self.registry, self.pool.all_states)
        getattr(self.prefix, "bind_states", lambda states: None)(self.pool.all_states)  # index capacities
        self.proxy = Proxy(config, self.pool, self.policy, self.prefix, self.metrics,
                           random.Random(seed), logging.getLogger("kvrouter.proxy"))
        self.rlog = request_logger()
        self.log_requests = config.logging.requests
        self.active = 0
        self.configured_models = config.model_names()
        self._keys = [k.encode() for k in config.auth.api_keys]
        self._admin = config.auth.admin_key.encode() if config.auth.admin_key else None
        self.session_header = str(config.policy.options.get("session_header", "x-session-id"))
        self.rid_header = config.headers.request_id_header
        self._rid_l = self.rid_header.lower()
        self.max_body = config.limits.max_body_bytes
        self.max_concurrent = config.limits.max_concurrent
        self.retry_after = str(config.limits.retry_after_s)
        self.ratelimit = build_rate_limiter(config.limits)  # per API key (router/ratelimit.py)
        self.conn_refused = refused_counter(self.registry)
        self.draining = False  # set by router.lifecycle on SIGTERM: /ready fails
        from router.discovery import Discovery

        self.discovery = Discovery(config, self.pool)  # resolver injectable before start
        from router.reservations import build_shared_load

        self.shared_load = build_shared_load(config, self.pool.all_states, self.registry)  # docs/scaling.md

    def _replica_removed(self, replica_id: str) -> None:
        self.prefix.replica_removed(replica_id)
        proxy = getattr(self, "proxy", None)
        if proxy is not None and self.pool.get(replica_id) is None:  # left the pool, not just ejected
            proxy.breakers.forget(replica_id)

    def _health_changed(self, replica_id: str, healthy: bool) -> None:
        if not healthy:
            self.metrics.ejection(replica_id)

    # ------------------------------------------------------------------ checks

    @staticmethod
    def _bearer(request: web.Request) -> bytes | None:
        h = request.headers.get("Authorization")
        if not h or h[:7].lower() != "bearer ":
            return None
        return h[7:].strip().encode()

    def client_ok(self, request: web.Request) -> bool:
        if not self._keys:
            return True
        got = self._bearer(request)
        if got is None:
            return False
        # every key is compared (no early exit): the time taken does not tell which key matched
        return sum(hmac.compare_digest(got, k) for k in self._keys) > 0

    def admin_ok(self, request: web.Request) -> bool:
        got = self._bearer(request)
        return self._admin is not None and got is not None and hmac.compare_digest(got, self._admin)

    def request_id(self, request: web.Request) -> str:
        rid = request.headers.get(self.rid_header)
        if rid and len(rid) <= 200 and rid.isprintable():
            return rid
        return os.urandom(12).hex()

    def upstream_headers(self, request: web.Request, rid: str) -> dict[str, str]:
        """The client's headers minus hop-by-hop ones (the fixed list and any the client's
        ``Connection`` header names) and its key when the router checks keys, with the
        request id; header names that the router sets are canonicalised so a
        replica's own key replaces, never duplicates, the client's."""
        drop_auth = bool(self._keys)
        rid_l = self._rid_l
        out: dict[str, str] = {}
        conn: list[str] | None = None
        for k, v in request.headers.items():
            lk = k.lower()
            if lk in REQUEST_DROP or lk == rid_l:
                if lk == "connection" and v != "keep-alive" and v != "close":
                    conn = [v] if conn is None else [*conn, v]
                continue
            if lk == "authorization":
                if not drop_auth:
                    out["Authorization"] = v
                continue
            out[k] = v
        if conn is not None and (named := connection_named(conn)):  # RFC 9110 §7.6.1: hop-by-hop too
            out = {k: v for k, v in out.items() if k.lower() not in named}
        out[self.rid_header] = rid
        return out


STATE = web.AppKey("kvrouter", RouterState)


def _err(status: int, message: str, type_: str, code: str, param: str | None = None,
         headers: dict[str, str] | None = None) -> web.Response:
    return error_response(status, message, type_, code, headers=headers, param=param)


def _with_rid(resp: web.Response, st: RouterState, rid: str) -> web.Response:
    resp.headers[st.rid_header] = rid
    return resp


def _unauthorized() -> web.Response:
    return _err(401, "Invalid or missing API key (Authorization: Bearer KEY)", "invalid_request_error",
                "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


# ---------------------------------------------------------------------- handlers


async def handle_proxy(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    rid = st.request_id(request)
    model = ""
    ctx: RequestContext | None = None
    status = 0
    if not st.client_ok(request):
        st.metrics.reject("unauthorized")
        return _with_rid(_unauthorized(), st, rid)
    if st.ratelimit is not None:
        allowed, wait = st.ratelimit.allow(st._bearer(request) or (request.remote or "").encode(), t0)
        if not allowed:
            st.metrics.reject("rate_limited")
            return _with_rid(_err(429, "Rate limit exceeded for this API key (limits.rate_limit_rps)",
                                  "rate_limit_error", "rate_limit_exceeded",
                                  headers={"Retry-After": str(max(1, -int(-wait // 1)))}), st, rid)
    if st.active >= st.max_concurrent:
        st.metrics.reject("concurrency")
        return _with_rid(_err(429, f"Too many concurrent requests (limits.max_concurrent={st.max_concurrent})",
                              "rate_limit_error", "too_many_requests", headers={"Retry-After": st.retry_after}),
                         st, rid)
    st.active += 1
    try:
        resp = await _proxy_request(request, st, rid, t0)
        if isinstance(resp, RequestContext):
            ctx = resp
            model = ctx.model
            out = await st.proxy.forward(request, ctx)
            status = ctx.status or out.status
            return out
        status = resp.status
        return _with_rid(resp, st, rid)
    except asyncio.CancelledError:
        status = 499  # the client went away; the upstream request is closed by the proxy
        raise
    finally:
        st.active -= 1
        if ctx is not None:
            end = loop.time()
            fb = None if ctx.first_byte_at is None else ctx.first_byte_at - t0
            st.metrics.request_done(model, ctx.replica or "none", status, end - t0, fb)
            if st.log_requests:
                st.rlog.info("request", extra={"fields": {
                    "request_id": rid, "path": request.path, "model": model, "replica": ctx.replica,
                    "policy": st.proxy.policy_name, "reason": ctx.reason, "status": status,
                    "attempts": ctx.attempts, "ms": round((end - t0) * 1000, 2),
                    "first_byte_ms": None if fb is None else round(fb * 1000, 2)}})


async def read_body(request: web.Request, st: RouterState) -> bytes | web.Response:
    """The request body, bounded by ``limits.max_body_bytes`` and decoded from its
    ``Content-Encoding`` (router/body_encoding.py); an OpenAI-style 4xx error otherwise."""
    cl = request.content_length
    if cl is not None and cl > st.max_body:
        st.metrics.reject("body_too_large")
        return _err(413, f"Request body too large (limit {st.max_body} bytes)", "invalid_request_error",
                    "body_too_large")
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        st.metrics.reject("body_too_large")
        return _err(413, f"Request body too large (limit {st.max_body} bytes)", "invalid_request_error",
                    "body_too_large")
    if hdrs.CONTENT_ENCODING in request.headers:  # decoded here, forwarded plain
        coding = ", ".join(request.headers.getall(hdrs.CONTENT_ENCODING))
        try:
            if len(body) > _DECODE_INLINE:  # big bodies are decoded off the event loop
                return await asyncio.to_thread(decode_body, body, coding, st.max_body)
            return decode_body(body, coding, st.max_body)
        except BodyEncodingError as exc:
            st.metrics.reject(exc.code)
            return _err(exc.status, exc.message, "invalid_request_error", exc.code,
                        param="Content-Encoding" if exc.status != 413 else None)
    return body


async def _proxy_request(request: web.Request, st: RouterState, rid: str,
                         t0: float) -> web.Response | RequestContext:
    """Validate a proxied request; an error response, or the context to forward."""
    body = await read_body(request, st)
    if isinstance(body, web.Response):
        return body
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        st.metrics.reject("invalid_json")
        return _err(400, f"Request body is not valid JSON: {exc}", "invalid_request_error", "invalid_json")
    if not isinstance(parsed, dict):
        st.metrics.reject("invalid_json")
        return _err(400, "Request body must be a JSON object", "invalid_request_error", "invalid_json")
    model = parsed.get("model")
    if model is None:
        if len(st.configured_models) != 1:
            st.metrics.reject("missing_model")
            return _err(400, "The 'model' field is required", "invalid_request_error", "missing_model",
                        param="model")
        model = st.configured_models[0]
    elif not isinstance(model, str):
        st.metrics.reject("invalid_model")
        return _err(400, "The 'model' field must be a string", "invalid_request_error", "invalid_model",
                    param="model")
    if not st.pool.has_model(model):
        st.metrics.reject("model_not_found")
        return _err(404, f"The model `{model}` does not exist", "invalid_request_error", "model_not_found",
                    param="model")
    session_key = request.headers.get(st.session_header)
    if session_key is None:
        user = parsed.get("user")
        session_key = user if isinstance(user, str) and user else None
    return RequestContext(method=request.method, path_qs=request.raw_path, body=body, parsed=parsed,
                          model=model, request_id=rid, session_key=session_key, t0=t0,
                          upstream_headers=st.upstream_headers(request, rid))


async def handle_models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if not st.client_ok(request):
        return _unauthorized()
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "kvrouter"} for m in st.pool.healthy_models()]
    return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type="application/json")


async def handle_health(request: web.Request) -> web.Response:
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


async def handle_ready(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if st.draining:
        return web.Response(status=503, body=b'{"ready":false,"draining":true}', content_type="application/json")
    healthy = set(st.pool.healthy_models())
    missing = [m for m in st.pool.models() if m not in healthy]
    ok = not missing and bool(st.pool.models())
    body = {"ready": ok, "models": {m: m in healthy for m in st.pool.models()}}
    return web.Response(status=200 if ok else 503, body=orjson.dumps(body), content_type="application/json")


async def handle_metrics(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if not st.config.auth.metrics_public and not st.admin_ok(request):
        return _unauthorized()
    return web.Response(body=st.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def handle_not_found(request: web.Request) -> web.Response:
    """404, or 405 with ``Allow`` when the path exists for other methods (``GET /v1/completions``)."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        match, methods = await resource.resolve(request)
        if match is None:  # the catch-all (this handler) matches; the others only on the path
            allowed |= methods
    allowed.discard("*")
    if allowed:
        allow = ", ".join(sorted(allowed))
        return _err(405, f"Method {request.method} not allowed for {request.path} (allowed: {allow})",
                    "invalid_request_error", "method_not_allowed", headers={"Allow": allow})
    return _err(404, f"No route for {request.method} {request.path}", "invalid_request_error", "not_found")


# ---------------------------------------------------------------------- app and serving


def build_app(config: Config, *, prefix: PrefixService | None = None,
              registry: CollectorRegistry | None = None, seed: int | None = None) -> web.Application:
    app = web.Application(client_max_size=config.limits.max_body_bytes, handler_args=None)
    st = RouterState(config, prefix=prefix, registry=registry, seed=seed)
    app[STATE] = st
    r = app.router
    r.add_post("/v1/completions", handle_proxy)
    r.add_post("/v1/chat/completions", handle_proxy)
    r.add_get("/v1/models", handle_models)
    r.add_post("/v1/{tail:.+}", handle_proxy)
    r.add_get("/health", handle_health)
    r.add_get("/ready", handle_ready)
    r.add_get("/metrics", handle_metrics)
    from router import admin, debug_route  # they use this module's helpers: imported here

    r.add_get("/admin/replicas", admin.handle_admin_list)
    r.add_post("/admin/replicas", admin.handle_admin_add)
    r.add_delete("/admin/replicas/{id}", admin.handle_admin_remove)
    r.add_post("/debug/route", debug_route.handle_debug_route)
    r.add_route("*", "/{tail:.*}", handle_not_found)

    async def on_startup(app: web.Application) -> None:
        await st.prefix.start()
        await st.proxy.start()
        await st.pool.start()
        await st.discovery.start()
        if st.shared_load is not None:
            await st.shared_load.start()

    async def on_cleanup(app: web.Application) -> None:
        if st.shared_load is not None:
            await st.shared_load.close()
        await st.discovery.close()
        await st.pool.close()
        await st.proxy.close()
        await st.prefix.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def runner_for(app: web.Application, config: Config) -> web.AppRunner:
    lim = config.limits
    # GuardedRunner: OpenAI-shaped protocol errors, connection cap, idle connections closed
    # auto_decompress off: request Content-Encoding is decoded (bounded) by router.body_encoding
    return GuardedRunner(app, max_connections=lim.max_connections, on_refused=app[STATE].conn_refused.inc,
                         auto_decompress=False,
                         keepalive_timeout=lim.client_idle_timeout_s,
                         handle_signals=False, access_log=None, handler_cancellation=True,
                         shutdown_timeout=config.lifecycle.shutdown_grace_s,
                         max_line_size=lim.max_header_line_bytes, max_field_size=lim.max_header_field_bytes,
                         max_headers=lim.max_headers)


class Server:
    """A started router: ``await Server(config).start()``; ``.url``; ``await .stop()``."""

    def __init__(self, config: Config, *, prefix: PrefixService | None = None, seed: int | None = None) -> None:
        self.config = config
        self.app = build_app(config, prefix=prefix, seed=seed)
        self.runner = runner_for(self.app, config)
        self.port = config.listen.port

    @property
    def state(self) -> RouterState:
        return self.app[STATE]

    @property
    def url(self) -> str:
        return f"http://{self.config.listen.host}:{self.port}"

    async def start(self) -> Server:
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.config.listen.host, self.config.listen.port, backlog=2048,
                           reuse_port=self.config.listen.reuse_port or None)
        await site.start()
        server = site._server
        if server is not None and getattr(server, "sockets", None):
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()


async def serve_forever(config: Config, *, on_ready: Callable[[Server], Any] | None = None,
                        loader: Callable[[], Config] | None = None, watch_path: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then drain; SIGHUP reloads via ``loader`` (router/lifecycle.py)."""
    from router.lifecycle import serve

    await serve(config, on_ready=on_ready, loader=loader, watch_path=watch_path)


def run(coro_factory: Callable[[], Any]) -> None:
    """Run a coroutine on uvloop when available, else asyncio."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro_factory())
        return
    uvloop.run(coro_factory())
