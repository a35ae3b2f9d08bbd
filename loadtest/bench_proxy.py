"""Router overhead benchmark: the same load straight at a backend and through kvrouter, in one run.

    python -m loadtest.bench_proxy [--requests 4000] [--concurrency 32] [--prompt-bytes 2048]
                                   [--backend echo|sim] [--replicas 1] [--stream] [--compare auto]

Starts the backend(s) (``echo``: a minimal OpenAI-shaped aiohttp server, so the backend
costs little; ``sim``: ``kvrouter sim``), then for each target — ``direct`` (backend 0),
``kvrouter`` (``kvrouter serve``, round_robin, request log off), and when installed
``sglang-router`` / ``vllm-router`` — runs a warm-up and then the measured load from this
process (aiohttp, uvloop), and prints req/s, p50/p99 latency and the proxy process's CPU
milliseconds per request (user + system time from ``/proc/PID/stat`` over the measured
window, divided by the requests completed). Everything runs on 127.0.0.1; every process
started is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import orjson

from loadtest.procs import free_port

ROOT = Path(__file__).resolve().parents[1]
CLK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------- echo backend (child)


def serve_echo(port: int, model: str) -> None:
    from aiohttp import web

    answer = orjson.dumps({"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": model,
                           "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
                           "usage": {"prompt_tokens": 512, "completion_tokens": 1, "total_tokens": 513}})
    chunk = b"data: " + orjson.dumps({"id": "cmpl-bench", "object": "text_completion", "model": model,
                                      "choices": [{"index": 0, "text": " ok", "finish_reason": None}]}) + b"\n\n"

    async def completions(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        if not body.get("stream"):
            return web.Response(body=answer, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(8):
            await resp.write(chunk)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/server_info", lambda r: web.json_response({}))
    app.router.add_get("/get_model_info", lambda r: web.json_response({"model_path": model}))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# ---------------------------------------------------------------------- processes


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / CLK  # utime + stime of this process

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def spawn(name: str, argv: list[str], url: str, ready_path: str = "/health", timeout: float = 60) -> Child:
    log = Path(tempfile.mkstemp(prefix=f"bench-{name}-", suffix=".log")[1])
    with open(log, "ab") as lf:
        proc = subprocess.Popen(argv, stdout=lf, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    child = Child(name, proc, url, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited early:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + ready_path, timeout=0.5) as r:
                if r.status == 200:
                    return child
        except Exception:
            pass
        time.sleep(0.1)
    child.stop()
    raise RuntimeError(f"{name} not ready:\n{log.read_text()[-2000:]}")


# ---------------------------------------------------------------------- load


async def run_load(url: str, body: bytes, n: int, concurrency: int, stream: bool) -> tuple[list[float], int, float]:
    import aiohttp

    lat: list[float] = []
    errors = 0
    it = iter(range(n))
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def worker() -> None:
            nonlocal errors
            for _ in it:
                t = time.perf_counter()
                try:
                    async with s.post(url + "/v1/completions", data=body,
                                      headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    lat.append(time.perf_counter() - t)
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return lat, errors, wall


@dataclass
class Row:
    target: str
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_ms: float | None
    errors: int


def measure(target: str, url: str, child: Child | None, body: bytes, args: argparse.Namespace) -> Row:
    asyncio.run(run_load(url, body, args.warmup, args.concurrency, args.stream))
    cpu0 = child.cpu_s() if child else 0.0
    lat, errors, wall = asyncio.run(run_load(url, body, args.requests, args.concurrency, args.stream))
    cpu1 = child.cpu_s() if child else 0.0
    lat.sort()
    done = len(lat)
    return Row(target, done / wall if wall else 0.0,
               1000 * statistics.median(lat) if lat else float("nan"),
               1000 * lat[min(done - 1, int(0.99 * done))] if lat else float("nan"),
               (1000 * (cpu1 - cpu0) / done) if child and done else None, errors)


def print_rows(rows: list[Row], args: argparse.Namespace) -> None:
    print(f"\nrouter overhead: {args.requests} requests, concurrency {args.concurrency}, "
          f"{args.prompt_bytes} B prompts, {'stream' if args.stream else 'non-stream'}, "
          f"{args.replicas} {args.backend} backend(s), 127.0.0.1, {os.cpu_count()} CPUs")
    print(f"{'target':<16}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'proxy CPU-ms/req':>18}{'errors':>8}"
          f"{'req/s vs direct':>17}")
    base = rows[0].rps if rows else 0.0
    for r in rows:
        cpu = f"{r.cpu_ms:.3f}" if r.cpu_ms is not None else "-"
        ratio = f"{r.rps / base:.2f}x" if base else "-"
        print(f"{r.target:<16}{r.rps:>10.0f}{r.p50_ms:>10.2f}{r.p99_ms:>10.2f}{cpu:>18}{r.errors:>8}{ratio:>17}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_proxy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=4000, help="measured requests per target (default 4000)")
    p.add_argument("--warmup", type=int, default=500, help="warm-up requests per target (default 500)")
    p.add_argument("--concurrency", type=int, default=32, help="concurrent client requests (default 32)")
    p.add_argument("--prompt-bytes", type=int, default=2048, help="prompt size in bytes (default 2048)")
    p.add_argument("--stream", action="store_true", help="streamed requests (8 events each on echo)")
    p.add_argument("--backend", choices=("echo", "sim"), default="echo", help="backend kind (default echo)")
    p.add_argument("--replicas", type=int, default=1, help="backends behind the routers (default 1)")
    p.add_argument("--policy", default="round_robin", help="kvrouter policy (default round_robin)")
    p.add_argument("--compare", default="auto",
                   help="other routers: auto (those installed), none, or a comma list of sglang-router,vllm-router")
    p.add_argument("--other-python", default=sys.executable, metavar="PATH",
                   help="interpreter whose environment has sglang-router / vllm-router installed "
                        "(default: this one), e.g. a separate venv")
    p.add_argument("--serve-echo", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--model", default="bench-model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_echo:
        serve_echo(args.serve_echo, args.model)
        return 0
    prompt = ("The quick brown fox jumps over the lazy dog. " * (args.prompt_bytes // 45 + 1))[: args.prompt_bytes]
    body = orjson.dumps({"model": args.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                         "stream": args.stream})
    children: list[Child] = []
    rows: list[Row] = []
    try:
        backends = []
        for i in range(args.replicas):
            port = free_port()
            if args.backend == "echo":
                argv_b = [sys.executable, "-m", "loadtest.bench_proxy", "--serve-echo", str(port),
                          "--model", args.model]
            else:
                argv_b = [sys.executable, "-m", "router.cli", "sim", "--host", "127.0.0.1", "--port", str(port),
                          "--model", args.model, "--time-scale", "0", "--seed", str(i)]
            backends.append(spawn(f"backend{i}", argv_b, f"http://127.0.0.1:{port}"))
        children += backends
        rows.append(measure("direct", backends[0].url, backends[0], body, args))
        rport = free_port()
        cfg = Path(tempfile.mkstemp(prefix="bench-router-", suffix=".yaml")[1])
        cfg.write_text(orjson.dumps({
            "listen": {"host": "127.0.0.1", "port": rport}, "policy": {"name": args.policy},
            "replicas": [{"id": f"b{i}", "url": b.url, "models": [args.model]} for i, b in enumerate(backends)],
            "logging": {"requests": False, "level": "warning"}}).decode())
        router = spawn("kvrouter", [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)],
                       f"http://127.0.0.1:{rport}")
        children.append(router)
        rows.append(measure("kvrouter", router.url, router, body, args))
        router.stop()
        for name, argv_o in _others(args, [b.url for b in backends]):
            try:
                port = int(argv_o[argv_o.index("--port") + 1])
                other = spawn(name, argv_o, f"http://127.0.0.1:{port}", timeout=60)
            except RuntimeError as exc:
                print(f"{name}: could not start ({str(exc).splitlines()[0]})", file=sys.stderr)
                continue
            children.append(other)
            rows.append(measure(name, other.url, other, body, args))
            other.stop()
    finally:
        for c in children:
            c.stop()
    print_rows(rows, args)
    return 0


def _others(args: argparse.Namespace, urls: list[str]) -> list[tuple[str, list[str]]]:
    wanted = {"sglang-router", "vllm-router"} if args.compare == "auto" else (
        set() if args.compare == "none" else set(args.compare.split(",")))
    out = []
    py = args.other_python
    if "sglang-router" in wanted:
        found = subprocess.run([py, "-c", "import sglang_router"], capture_output=True).returncode == 0
        if not found:
            if args.compare != "auto":
                print("sglang-router not installed (pip install sglang-router)", file=sys.stderr)
        else:
            port, prom = free_port(), free_port()
            out.append(("sglang-router", [py, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                          "--port", str(port), "--prometheus-host", "127.0.0.1",
                                          "--prometheus-port", str(prom), "--policy", "round_robin",
                                          "--worker-urls", *urls]))
    if "vllm-router" in wanted:
        exe = shutil.which("vllm-router", path=str(Path(py).parent)) or shutil.which("vllm-router")
        if exe is None:
            if args.compare != "auto":
                print("vllm-router not installed (pip install vllm-router)", file=sys.stderr)
        else:
            port, prom = free_port(), free_port()
            out.append(("vllm-router", [py, exe, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port",
                                        str(prom), "--policy", "round_robin", "--worker-urls", *urls]))
    return out


if __name__ == "__main__":
    sys.exit(main())
