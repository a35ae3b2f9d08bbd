"""Live replay: send a trace's requests to an OpenAI-compatible endpoint over HTTP.

Open loop on the trace's timestamps divided by ``speed``: request ``i`` is sent at
``timestamp_i / speed`` seconds after the start, whatever happened to the earlier ones —
except that at most ``max_concurrency`` requests are in flight (a full window delays the
next send; the record's ``late_s`` says by how much) and nothing is sent after
``duration_s``. Every request streams (``stream_options.include_usage``) and yields one
record (a plain dict, written as one JSONL line by the CLI):

``i, scheduled_s, late_s, status, error, replica`` (from the router's replica header),
``ttft_s`` (first content chunk), ``itl_mean_s`` (mean gap between content chunks),
``e2e_s``, ``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` (usage
``prompt_tokens_details.cached_tokens``, absent = 0).

Prompts come from the trace's hash ids (:class:`~loadtest.traces.prompts.PromptBuilder`):
ASCII text (block-exact with the byte tokenizer) or token-id prompts; ``auto`` sends one
token-id prompt first (:func:`accepts_token_ids`) and uses token ids if the target accepts
it, text otherwise (always text for chat). When
``engine_metrics`` URLs are given, their ``/metrics`` are scraped before and after and the
vLLM prefix-cache counters' deltas give a second, engine-side hit rate (``auto``: the
replicas a kvrouter target lists at ``GET /admin/replicas``, which needs its admin key).

The only I/O module of replay; everything it computes from records is in
:mod:`loadtest.summary`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from backends.engines import engine_hit_delta, parse_prometheus
from loadtest.summary import summarize_records
from loadtest.traces.prompts import PromptBuilder
from loadtest.traces.types import TraceRequest


@dataclass(slots=True)
class LiveOptions:
    """Options of one live replay (the CLI flags of ``kvrouter replay --target``)."""

    target: str
    model: str | None = None  # None: the first model of GET /v1/models
    endpoint: str = "completions"  # completions | chat
    prompt_mode: str = "text"  # text | tokens (token-id prompts; completions only) | auto (probe)
    speed: float = 1.0
    max_concurrency: int = 256
    duration_s: float | None = None
    timeout_s: float = 600.0
    max_output_tokens: int | None = None
    replica_header: str = "x-kvrouter-replica"
    engine_metrics: tuple[str, ...] = ()
    api_key: str | None = None
    admin_key: str | None = None  # for engine_metrics=("auto",): kvrouter's admin API
    seed: int = 0
    vllm_extensions: bool = True  # send ignore_eos + min_tokens so outputs have the trace's length

    def validate(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError("endpoint must be 'completions' or 'chat'")
        if self.prompt_mode not in ("text", "tokens", "auto"):
            raise ValueError("prompt_mode must be 'text', 'tokens' or 'auto'")
        if self.prompt_mode == "tokens" and self.endpoint == "chat":
            raise ValueError("token-id prompts need the completions endpoint")
        if not self.speed > 0:
            raise ValueError("speed must be > 0")
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if not self.target.startswith(("http://", "https://")):
            raise ValueError("target must be an http(s):// URL")


@dataclass(slots=True)
class LiveResult:
    records: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


def base_url(target: str) -> str:
    """``http://host:port`` from a target given with or without ``/v1``."""
    t = target.rstrip("/")
    return t[:-3] if t.endswith("/v1") else t


def build_body(req: TraceRequest, opts: LiveOptions, model: str, prompts: PromptBuilder) -> tuple[str, dict]:
    """(path, JSON body) of one trace request."""
    n_out = req.output_length or 1
    if opts.max_output_tokens is not None:
        n_out = min(n_out, opts.max_output_tokens)
    if req.body is not None:
        body = dict(req.body)
        endpoint = req.endpoint
        if opts.model or "model" not in body:
            body["model"] = model
        if opts.max_output_tokens is not None:
            key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
            body[key] = min(int(body.get(key) or opts.max_output_tokens), opts.max_output_tokens)
    else:
        endpoint = opts.endpoint
        body = {"model": model, "max_tokens": n_out, "temperature": 0.0}
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompts.text(req)}]
        elif opts.prompt_mode == "tokens":
            body["prompt"] = prompts.token_ids(req)
        else:
            body["prompt"] = prompts.text(req)
        if opts.vllm_extensions:
            body["ignore_eos"] = True
            body["min_tokens"] = n_out
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    return path, body


def _content(chunk: dict[str, Any]) -> bool:
    return any(isinstance(ch, dict) and (ch.get("text") or (ch.get("delta") or {}).get("content"))
               for ch in chunk.get("choices") or ())


async def send_one(session: aiohttp.ClientSession, url: str, body: dict, opts: LiveOptions,
                   rec: dict[str, Any]) -> dict[str, Any]:
    """Send one streaming request and fill ``rec`` with its timings, usage and status."""
    headers = {"content-type": "application/json"}
    if opts.api_key:
        headers["authorization"] = f"Bearer {opts.api_key}"
    t0 = time.perf_counter()
    last = None
    gaps: list[float] = []
    chunks = 0
    usage: dict[str, Any] | None = None
    try:
        async with session.post(url, data=orjson.dumps(body), headers=headers,
                                timeout=aiohttp.ClientTimeout(total=opts.timeout_s)) as resp:
            rec["status"] = resp.status
            if opts.replica_header:
                rec["replica"] = resp.headers.get(opts.replica_header)
            if resp.status != 200:
                rec["error"] = (await resp.text())[:500]
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                try:
                    chunk = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    rec["error"] = "bad stream chunk"
                    continue
                if not isinstance(chunk, dict):
                    continue
                if "error" in chunk:
                    rec["error"] = str(chunk["error"])[:500]
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if _content(chunk):
                    now = time.perf_counter()
                    if last is None:
                        rec["ttft_s"] = now - t0
                    else:
                        gaps.append(now - last)
                    last = now
                    chunks += 1
    except TimeoutError:
        rec["error"] = "timeout"
    except aiohttp.ClientError as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
    rec["e2e_s"] = time.perf_counter() - t0
    if gaps:
        rec["itl_mean_s"] = sum(gaps) / len(gaps)
    if usage:
        rec["prompt_tokens"] = int(usage.get("prompt_tokens") or 0)
        rec["completion_tokens"] = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        rec["cached_tokens"] = int(details.get("cached_tokens") or 0)
    else:
        rec["completion_tokens"] = chunks
    return rec


async def first_model(session: aiohttp.ClientSession, target: str, api_key: str | None) -> str:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    async with session.get(base_url(target) + "/v1/models", headers=headers,
                           timeout=aiohttp.ClientTimeout(total=30)) as r:
        r.raise_for_status()
        data = await r.json()
    models = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]
    if not models:
        raise ValueError(f"{target} lists no models; pass --model")
    return str(models[0])


PROBE_TOKEN_IDS = [1000, 1001, 1002, 1003]  # within any real vocabulary


async def accepts_token_ids(session: aiohttp.ClientSession, target: str, model: str,
                            api_key: str | None) -> bool:
    """Whether ``target`` accepts a token-id ``prompt`` on ``/v1/completions`` (one request of
    one output token; any non-200 answer or a transport error means no)."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "prompt": PROBE_TOKEN_IDS, "max_tokens": 1, "temperature": 0.0}
    try:
        async with session.post(base_url(target) + "/v1/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=60)) as r:
            await r.read()
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def router_replicas(session: aiohttp.ClientSession, target: str, api_key: str | None) -> list[str]:
    """Replica URLs of a kvrouter target (``GET /admin/replicas``); [] when unavailable."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with session.get(base_url(target) + "/admin/replicas", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return []
            data = await r.json()
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return []
    reps = data.get("replicas") if isinstance(data, dict) else None
    return [str(x["url"]) for x in reps or () if isinstance(x, dict) and x.get("url")]


async def scrape(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[dict[str, float] | None]:
    """Parsed ``/metrics`` of each URL (None where the scrape failed)."""
    async def one(u: str) -> dict[str, float] | None:
        url = u if u.rstrip("/").endswith("/metrics") else u.rstrip("/") + "/metrics"
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
                return parse_prometheus(await r.text()) if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None
    return list(await asyncio.gather(*(one(u) for u in urls)))


def engine_summary(urls: Sequence[str], before: list, after: list) -> dict[str, Any]:
    per = {}
    q = h = 0.0
    for u, b, a in zip(urls, before, after, strict=True):
        d = engine_hit_delta(b or {}, a or {}) if a is not None else None
        per[u] = d
        if d:
            q += d["queries"]
            h += d["hits"]
    return {"engine_hit_rate": h / q if q else None, "engine_prefix_cache": per}


async def replay_live(requests: Sequence[TraceRequest], opts: LiveOptions,
                      on_record: Callable[[dict[str, Any]], None] | None = None) -> LiveResult:
    """Replay ``requests`` against ``opts.target``; records come back in trace order."""
    opts.validate()
    block = requests[0].block_size if requests else 16
    prompts = PromptBuilder(block, seed=opts.seed)
    result = LiveResult()
    conn = aiohttp.TCPConnector(limit=opts.max_concurrency + 4, force_close=False)
    async with aiohttp.ClientSession(connector=conn, read_bufsize=1 << 20) as session:
        model = opts.model or await first_model(session, opts.target, opts.api_key)
        if opts.prompt_mode == "auto":  # before the "before" scrape: the probe is not counted
            tokens = opts.endpoint == "completions" and await accepts_token_ids(
                session, opts.target, model, opts.api_key)
            opts.prompt_mode = "tokens" if tokens else "text"
        if tuple(opts.engine_metrics) == ("auto",):  # ask a kvrouter target for its replicas
            opts.engine_metrics = tuple(await router_replicas(session, opts.target,
                                                              opts.admin_key or opts.api_key))
        before = await scrape(session, opts.engine_metrics) if opts.engine_metrics else []
        sem = asyncio.Semaphore(opts.max_concurrency)
        records: list[dict[str, Any]] = []
        tasks: set[asyncio.Task] = set()
        loop = asyncio.get_running_loop()
        start = loop.time()
        base = base_url(opts.target)

        async def run(rec: dict[str, Any], path: str, body: dict) -> None:
            try:
                await send_one(session, base + path, body, opts, rec)
            finally:
                sem.release()
                if on_record:
                    on_record(rec)

        for i, req in enumerate(requests):
            t_sched = req.timestamp_s / opts.speed
            if opts.duration_s is not None and (t_sched > opts.duration_s
                                                or loop.time() - start > opts.duration_s):
                break
            delay = start + t_sched - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await sem.acquire()
            path, body = build_body(req, opts, model, prompts)
            rec: dict[str, Any] = {"i": i, "scheduled_s": round(t_sched, 6),
                                   "late_s": round(max(0.0, loop.time() - start - t_sched), 6),
                                   "status": None, "error": None, "replica": None, "ttft_s": None,
                                   "itl_mean_s": None, "e2e_s": None, "prompt_tokens": req.input_length,
                                   "completion_tokens": 0, "cached_tokens": 0}
            records.append(rec)
            t = asyncio.create_task(run(rec, path, body))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*list(tasks))
        wall = loop.time() - start
        result.records = records
        result.summary = summarize_records(records, wall)
        result.summary["model"] = model
        result.summary["speed"] = opts.speed
        result.summary["prompt_mode"] = opts.prompt_mode
        if opts.engine_metrics:
            after = await scrape(session, opts.engine_metrics)
            result.summary.update(engine_summary(opts.engine_metrics, before, after))
    return result
