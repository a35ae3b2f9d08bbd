"""Benchmark: how much load one ``kvrouter sim`` process serves at ``--time-scale 0``.

Starts a sim on a free loopback port (or uses ``--url``), then measures with an aiohttp
client on the same machine (so the figures include the client's own CPU cost):

1. short non-streamed completions (``--prompt-chars`` prompt, ``--short-max-tokens``
   output) at ``--concurrency`` → requests/s;
2. streamed completions (``--stream-max-tokens`` each) at ``--stream-concurrency`` →
   streamed tokens/s (from each stream's usage chunk) and SSE events/s.

Prints each figure next to the issue's target (≥ 500 req/s, ≥ 20,000 tokens/s) and the
ratio. Run: ``.venv/bin/python -m loadtest.bench_sim``.

``--engine`` instead times the pure engine model in virtual time, as the offline cluster
simulator drives it: a synthetic trace (default 12,031 requests, log-normal prompts of
mean ~11k tokens sharing prefixes, exponential outputs of mean 343, Poisson arrivals)
spread round-robin over 8 engines (llama-3.1-8b on a100-80gb), submitted with
precomputed block hashes and advanced with ``fast_forward``. Prints wall and CPU seconds
next to the 60 s budget of a whole offline replay.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
import urllib.request

import aiohttp
import orjson

from loadtest.procs import free_port as _free_port

TARGET_REQ_S = 500.0
TARGET_TOK_S = 20_000.0


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"sim exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("sim did not become ready")


async def _short(session: aiohttp.ClientSession, url: str, n: int, conc: int, prompt: str,
                 max_tokens: int) -> tuple[float, int]:
    body = orjson.dumps({"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": max_tokens})
    left = n
    ok = 0

    async def worker() -> None:
        nonlocal left, ok
        while left > 0:
            left -= 1
            async with session.post(url + "/v1/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as r:
                data = await r.read()
                if r.status == 200 and b'"completion_tokens"' in data:
                    ok += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return time.perf_counter() - t0, ok


async def _streams(session: aiohttp.ClientSession, url: str, n: int, conc: int, max_tokens: int) -> tuple[float, int, int]:
    left = n
    tokens = events = 0

    async def worker(i: int) -> None:
        nonlocal left, tokens, events
        while left > 0:
            left -= 1
            body = orjson.dumps({"model": "llama-3.1-8b", "prompt": f"stream {i} {left}", "max_tokens": max_tokens,
                                 "stream": True, "stream_options": {"include_usage": True}})
            async with session.post(url + "/v1/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as r:
                last = b""
                async for chunk in r.content.iter_any():
                    events += chunk.count(b"data: ")
                    last = (last + chunk)[-4096:]
                for event in reversed(last.split(b"\n\n")):
                    if event.startswith(b"data: {") and b'"usage"' in event:
                        tokens += int(orjson.loads(event[6:])["usage"]["completion_tokens"])
                        break

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(conc)))
    return time.perf_counter() - t0, tokens, events


async def _run(args: argparse.Namespace, url: str) -> None:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        prompt = ("The quick brown fox jumps over the lazy dog. " * 8)[:args.prompt_chars]
        await _short(session, url, 50, 4, prompt, args.short_max_tokens)  # warm up
        dt, ok = await _short(session, url, args.requests, args.concurrency, prompt, args.short_max_tokens)
        req_s = ok / dt
        print(f"short non-streamed: {ok}/{args.requests} ok in {dt:.2f} s, concurrency {args.concurrency}, "
              f"{len(prompt)}-token prompt, {args.short_max_tokens} tokens out")
        print(f"  requests/s         {req_s:10.0f}   target {TARGET_REQ_S:8.0f}   ratio {req_s / TARGET_REQ_S:5.2f}")
        dt, tokens, events = await _streams(session, url, args.stream_requests, args.stream_concurrency,
                                            args.stream_max_tokens)
        tok_s = tokens / dt
        print(f"streamed: {args.stream_requests} streams x {args.stream_max_tokens} tokens in {dt:.2f} s, "
              f"concurrency {args.stream_concurrency}; {events} SSE events ({events / dt:.0f}/s, "
              f"{tokens / max(events, 1):.1f} tokens per event)")
        print(f"  streamed tokens/s  {tok_s:10.0f}   target {TARGET_TOK_S:8.0f}   ratio {tok_s / TARGET_TOK_S:5.2f}")


def engine_bench(n: int, replicas: int, rate: float, seed: int = 0) -> None:
    import random

    from backends.planner import PlanInput, Roofline, get_gpu, get_model
    from backends.sim.engine import EngineConfig, EngineModel, Request

    rl = Roofline(PlanInput(model=get_model("llama-3.1-8b"), gpu=get_gpu("a100-80gb")))
    engines = [EngineModel(EngineConfig(num_blocks=rl.kv_capacity_blocks, max_model_len=131072), rl)
               for _ in range(replicas)]
    rng = random.Random(seed)
    prefixes = [[rng.getrandbits(64) for _ in range(400)] for _ in range(50)]
    trace: list[tuple[float, int, Request]] = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = min(100_000, max(100, int(rng.lognormvariate(9.0, 0.8))))
        shared = min(prompt // 16, rng.randrange(400))
        hashes = prefixes[rng.randrange(50)][:shared] + [rng.getrandbits(64) for _ in range(prompt // 16 - shared)]
        trace.append((t, i % replicas, Request(str(i), prompt, max(1, int(rng.expovariate(1 / 343))),
                                               block_hashes=hashes)))
    mean_prompt = sum(r.prompt_len for _, _, r in trace) / n
    wall0, cpu0 = time.perf_counter(), time.process_time()
    clock = [0.0] * replicas
    calls = 0
    for arrival, e, req in trace:
        eng, x = engines[e], clock[e]
        while eng.has_work() and x < arrival:
            x = eng.fast_forward(x, until=arrival).end
            calls += 1
        eng.submit(req, arrival)
        clock[e] = max(x, arrival)
    for e, eng in enumerate(engines):
        while eng.has_work():
            clock[e] = eng.fast_forward(clock[e]).end
            calls += 1
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    steps = sum(eng.stats.steps for eng in engines)
    hits = sum(eng.stats.prefix_cache_hits for eng in engines) / sum(eng.stats.prefix_cache_queries for eng in engines)
    print(f"engine model: {n} requests (mean prompt {mean_prompt:.0f} tokens) over {replicas} engines, "
          f"{max(clock):.0f} simulated s, {steps} engine steps in {calls} calls, hit rate {hits:.3f}")
    print(f"  wall s {wall:8.2f}   cpu s {cpu:8.2f}   budget 60 s   ratio (cpu / budget) {cpu / 60:5.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="benchmark a running sim instead of starting one")
    p.add_argument("--requests", type=int, default=4000, help="short requests (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=32, help="short requests in flight (default: %(default)s)")
    p.add_argument("--prompt-chars", type=int, default=64, help="short prompt length (default: %(default)s)")
    p.add_argument("--short-max-tokens", type=int, default=8, help="short output tokens (default: %(default)s)")
    p.add_argument("--stream-requests", type=int, default=64, help="streamed requests (default: %(default)s)")
    p.add_argument("--stream-concurrency", type=int, default=16, help="streams in flight (default: %(default)s)")
    p.add_argument("--stream-max-tokens", type=int, default=2000, help="tokens per stream (default: %(default)s)")
    p.add_argument("--engine", action="store_true", help="time the pure engine model offline instead (no HTTP)")
    p.add_argument("--engine-requests", type=int, default=12_031, help="--engine: requests (default: %(default)s)")
    p.add_argument("--engine-replicas", type=int, default=8, help="--engine: engines (default: %(default)s)")
    p.add_argument("--engine-rate", type=float, default=3.0,
                   help="--engine: arrivals per simulated second (default: %(default)s)")
    args = p.parse_args(argv)
    if args.engine:
        engine_bench(args.engine_requests, args.engine_replicas, args.engine_rate)
        return 0
    proc = None
    url = args.url
    if url is None:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-m", "router.cli", "sim", "--port", str(port),
                                 "--time-scale", "0"], stdout=subprocess.DEVNULL)
        _wait_ready(url, proc)
    try:
        asyncio.run(_run(args, url))
    finally:
        if proc is not None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
