"""The simulated engine's HTTP server (aiohttp): vLLM's OpenAI API over one :class:`EngineModel`.

One asyncio task drives the engine: it runs a step, waits the step's simulated duration ×
``time_scale`` of wall time (0 = no waiting at all), then wakes the handlers of the requests
that got tokens. Each HTTP request holds one ``asyncio.Event``; a streaming handler drains
every token produced since it last ran into one SSE event, so tokens coalesce whenever the
engine outpaces the client. A handler that ends early (client gone) cancels its requests in
the engine, freeing their blocks.

The simulated clock: while the engine is busy it advances step by step; while idle it
follows wall time ÷ ``time_scale`` (at scale 0 it stands still when idle). Every duration in
``/metrics`` is simulated time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from backends.sim import api
from backends.sim.api import ApiError
from backends.sim.engine import EngineModel, Request, StepResult
from backends.sim.metrics import SimMetrics
from backends.sim.tokenizer import SimTokenizer

log = logging.getLogger("kvrouter.sim")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
MAX_BEHIND_S = 0.05  # wall seconds the driver may lag before it stops trying to catch up
YIELD_EVERY_S = 0.001  # at time scale 0: wall seconds of back-to-back steps between yields


class _Waiter:
    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = asyncio.Event()


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class SimServer:
    """HTTP front of one simulated engine. ``make_app()`` returns the aiohttp application."""

    def __init__(self, engine: EngineModel, tok: SimTokenizer, *, served: tuple[str, ...],
                 time_scale: float = 1.0, root: str = "", info: dict[str, Any] | None = None,
                 default_max_tokens: int = 0, kv_publisher: Any = None) -> None:
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.engine = engine
        self.tok = tok
        self.served = served
        self.scale = time_scale
        self.root = root or served[0]
        self.info = dict(info or {})
        self.default_max_tokens = default_max_tokens
        self.kv_publisher = kv_publisher  # backends.sim.kv_publisher.KVEventPublisher or None
        cfg = engine.config
        self.metrics = SimMetrics(served[0], {
            "block_size": cfg.block_size, "num_gpu_blocks": cfg.num_blocks,
            "enable_prefix_caching": cfg.enable_prefix_caching,
            "cache_dtype": self.info.get("kv_dtype", "auto"),
            "gpu_memory_utilization": self.info.get("gpu_memory_utilization", 0.9)})
        self.max_model_len = cfg.max_model_len
        self.sim_now = 0.0
        self._anchor = (time.monotonic(), 0.0)  # (wall, sim) pair the clock runs from
        self._idle = True
        self.engine_errors = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._prefix = secrets.token_hex(6)
        self.started = int(time.time())

    # -- clock and driver -------------------------------------------------------------------
    def now(self) -> float:
        """The simulated time of an arrival happening now: while idle, wall time ÷ scale since
        the engine went idle; while busy, within the step in progress (a request arriving
        during a step joins the next one, which starts when this one ends)."""
        if self.scale <= 0:
            return self.sim_now
        wall, sim = self._anchor
        t = max(self.sim_now, sim + (time.monotonic() - wall) / self.scale)
        return t if self._idle else min(t, max(self.engine.busy_until, self.sim_now))

    async def _drive(self) -> None:
        """The driver task: runs the engine; a failing step (a bug) aborts the requests in
        flight (their clients get an error) instead of leaving them hanging."""
        while True:
            try:
                await self._drive_loop()
            except Exception:
                log.exception("engine step failed: aborting %d requests", len(self.engine.requests))
                self.engine_errors += 1
                for r in list(self.engine.requests.values()):
                    self.engine.cancel(r.req_id, self.sim_now)
                    if r.tag is not None:
                        r.tag.event.set()

    async def _drive_loop(self) -> None:
        eng, scale = self.engine, self.scale
        assert self._wake is not None
        last_yield = time.monotonic()
        while True:
            if not eng.has_work():
                if scale > 0:
                    self._anchor = (time.monotonic(), self.sim_now)
                self._idle = True
                await self._wake.wait()
                self._wake.clear()
                if scale > 0:  # start at the latest arrival, not at wake-up (host latency is not
                    # simulated time), and never before a request it schedules has arrived
                    last = max((r.arrival for r in eng.waiting), default=self.now())
                    self.sim_now = max(self.sim_now, min(last, self.now()))
                    self._anchor = (time.monotonic(), self.sim_now)
                self._idle = False
                last_yield = time.monotonic()
                continue
            res = eng.step(self.sim_now)  # back to back while busy
            if res.steps == 0:  # nothing schedulable (should not happen): do not spin
                await asyncio.sleep(0.001)
                continue
            self.metrics.observe(res)
            if scale > 0:
                wall0, sim0 = self._anchor
                delay = wall0 + (res.end - sim0) * scale - time.monotonic()
                if delay > 0.0002:
                    await asyncio.sleep(delay)
                    last_yield = time.monotonic()
                elif delay < -MAX_BEHIND_S:  # fell behind (slow machine): drop the debt
                    self._anchor = (time.monotonic(), res.end)
            self.sim_now = res.end
            self._deliver(res)
            if self.kv_publisher is not None:
                await self._publish_kv()
            t = time.monotonic()
            if t - last_yield > YIELD_EVERY_S:
                await asyncio.sleep(0)
                last_yield = time.monotonic()

    @staticmethod
    def _deliver(res: StepResult) -> None:
        for r, _ in res.tokens:
            w = r.tag
            if w is not None:
                w.event.set()

    async def _publish_kv(self) -> None:
        """Send the KV-cache events recorded since the last call as one batch (as vLLM does per step)."""
        from backends.sim.kv_publisher import convert

        events = self.engine.drain_kv_events()
        if events:
            await self.kv_publisher.publish(convert(events))

    async def _on_startup(self, app: web.Application) -> None:
        if self.kv_publisher is not None:
            await self.kv_publisher.start()
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._drive())

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.kv_publisher is not None:
            await self.kv_publisher.close()

    # -- app ---------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=256 * 1024 * 1024)
        r = app.router
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/v1/completions/render", self.render_completion)
        r.add_post("/v1/chat/completions/render", self.render_chat)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_get("/metrics", self.metrics_page)
        r.add_get("/version", self.version)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/get_load", self.get_load)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_route("*", "/flush_cache", self.reset_prefix_cache)
        r.add_get("/debug/kv_blocks", self.kv_blocks)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    @web.middleware
    async def _errors(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return _json(e.body(), e.status)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _json(api.error_body(e.status, e.reason or "error"), e.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # never a traceback to the client
            log.exception("internal error on %s", request.path)
            return _json(api.error_body(500, f"internal error: {type(e).__name__}"), 500)

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise ApiError(400, f"Invalid JSON body: {e}") from None

    # -- generation --------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        g = api.parse_generation(await self._body(request), chat=chat, tok=self.tok, served=self.served,
                                 max_model_len=self.max_model_len,
                                 default_max_tokens=self.default_max_tokens)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self._prefix}{next(self._ids):x}"
        waiter = _Waiter()
        now = self.now()
        reqs = [Request(f"{rid}-{i}", len(ids), g.max_tokens, prompt_ids=ids, cache_salt=g.cache_salt,
                        seed=g.seed, tag=waiter) for i, ids in enumerate(g.prompts)]
        try:
            for r in reqs:
                self.engine.submit(r, now)
        except ValueError as e:
            for r in reqs:
                self.engine.cancel(r.req_id, now)
            raise ApiError(400, str(e)) from None
        assert self._wake is not None
        self._wake.set()
        try:
            if g.stream:
                resp = web.StreamResponse(headers=SSE_HEADERS)
                try:
                    await self._stream(request, resp, g, rid, reqs, waiter)
                except ConnectionResetError:  # the client went away: cancelled below
                    log.debug("client of %s disconnected", rid)
                return resp
            while not all(r.finished for r in reqs):
                await waiter.event.wait()
                waiter.event.clear()
            if any(r.finish_reason == "abort" for r in reqs):
                raise ApiError(500, "the simulated engine failed while running this request")
            created = int(time.time())
            use = self._usage(reqs)
            texts = [self.tok.decode(r.output_ids or []) for r in reqs]
            if chat:
                return _json(api.chat_response(rid, created, g.model, texts[0], reqs[0].finish_reason, use))
            return _json(api.completion_response(rid, created, g.model, texts,
                                                 [r.finish_reason for r in reqs], use))
        finally:
            for r in reqs:
                if not r.finished:
                    self.engine.cancel(r.req_id, self.now())

    @staticmethod
    def _usage(reqs: list[Request]) -> dict[str, Any]:
        return api.usage(sum(r.prompt_len for r in reqs), sum(r.num_output for r in reqs),
                         sum(r.cached_tokens for r in reqs))

    async def _stream(self, request: web.Request, resp: web.StreamResponse, g: api.GenRequest, rid: str,
                      reqs: list[Request], waiter: _Waiter) -> None:
        await resp.prepare(request)
        created = int(time.time())
        model, chat, decode = g.model, g.chat, self.tok.decode
        if chat:
            await resp.write(_sse(api.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None)))
        sent = [0] * len(reqs)
        done = [False] * len(reqs)
        while not all(done):
            await waiter.event.wait()
            waiter.event.clear()
            parts: list[bytes] = []
            for i, r in enumerate(reqs):
                if done[i]:
                    continue
                n = r.num_output
                if n > sent[i] or r.finished:
                    text = decode(r.output_ids[sent[i]:n]) if r.output_ids is not None else ""
                    sent[i] = n
                    reason = r.finish_reason if r.finished else None
                    done[i] = r.finished
                    if chat:
                        parts.append(_sse(api.chat_chunk(rid, created, model, {"content": text}, reason)))
                    else:
                        parts.append(_sse(api.completion_chunk(rid, created, model, i, text, reason)))
            if parts:
                await resp.write(b"".join(parts))
        tail = b""
        if g.include_usage:
            tail = _sse(api.usage_chunk(rid, created, model, chat, self._usage(reqs)))
        await resp.write(tail + b"data: [DONE]\n\n")
        await resp.write_eof()

    # -- other endpoints -----------------------------------------------------------------------
    async def render_completion(self, request: web.Request) -> web.Response:
        """The prompt(s) exactly as the engine tokenizes them (newer vLLM; vllm-router uses it)."""
        g = api.parse_generation(await self._body(request), chat=False, tok=self.tok, served=self.served,
                                 max_model_len=self.max_model_len, default_max_tokens=1)
        return _json([{"token_ids": ids} for ids in g.prompts])

    async def render_chat(self, request: web.Request) -> web.Response:
        g = api.parse_generation(await self._body(request), chat=True, tok=self.tok, served=self.served,
                                 max_model_len=self.max_model_len, default_max_tokens=1)
        return _json({"token_ids": g.prompts[0]})

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": name, "object": "model", "created": self.started, "owned_by": "vllm",
                 "root": self.root, "parent": None, "max_model_len": self.max_model_len,
                 "permission": []} for name in self.served]
        return _json({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        from router import __version__

        return _json({"version": f"kvrouter-sim {__version__}"})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        api.check_model(body, self.served)
        if "messages" in body:
            msgs = api.check_messages(body["messages"])
            ids = self.tok.encode(self.tok.render_chat(msgs, bool(body.get("add_generation_prompt", True))))
        elif isinstance(body.get("prompt"), str):
            ids = self.tok.encode(body["prompt"])
        else:
            raise ApiError(400, "`prompt` (a string) or `messages` is required", "prompt")
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                               "token_strs": self.tok.token_strs(ids) if body.get("return_token_strs") else None}
        return _json(out)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not isinstance(body, dict) or not api._token_list(body.get("tokens")):
            raise ApiError(400, "`tokens` must be a list of token ids", "tokens")
        api.check_model(body, self.served)
        if any(t < 0 for t in body["tokens"]):
            raise ApiError(400, "token ids must be non-negative", "tokens")
        return _json({"prompt": self.tok.decode(body["tokens"])})

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(self.engine).encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def server_info(self, request: web.Request) -> web.Response:
        cfg = self.engine.config
        return _json({**self.info, "model_path": self.root, "served_model_name": self.served[0],
                      "tokenizer_path": self.tok.name, "context_length": cfg.max_model_len,
                      "max_total_num_tokens": cfg.num_blocks * cfg.block_size, "page_size": cfg.block_size,
                      "max_running_requests": cfg.max_num_seqs, "chunked_prefill_size": cfg.max_num_batched_tokens,
                      "disable_radix_cache": not cfg.enable_prefix_caching,
                      "speculative_num_draft_tokens": cfg.spec_tokens, "version": "kvrouter-sim"})

    async def model_info(self, request: web.Request) -> web.Response:
        return _json({"model_path": self.root, "tokenizer_path": self.tok.name, "is_generation": True})

    async def get_load(self, request: web.Request) -> web.Response:
        eng = self.engine
        used = (eng.config.num_blocks - eng.kv.num_free) * eng.config.block_size
        return _json([{"dp_rank": 0, "num_reqs": eng.num_running + eng.num_waiting,
                       "num_waiting_reqs": eng.num_waiting, "num_tokens": used}])

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.engine.reset_prefix_cache()
        if self.kv_publisher is not None:
            await self._publish_kv()
        return web.Response(status=200)

    async def kv_blocks(self, request: web.Request) -> web.Response:
        return _json(self.engine.kv.cached_hashes())
