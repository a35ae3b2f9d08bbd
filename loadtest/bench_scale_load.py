"""Load generation for ``loadtest.bench_scale``'s throughput part: the workloads and the two
generators (wrk, or an aiohttp client in the benchmark's own process).

Two workloads, both closed-loop over keep-alive connections:

* ``light`` — round_robin, one fixed 480-character completion prompt: the router's cheapest
  path (parse, choose, proxy). Per request the router costs about as much as the backends and
  the generator together, so on a 2-core machine the three compete for the cores.
* ``router-bound`` — cache_aware with a BPE ``tokenizer.json`` (trained by the benchmark, no
  downloads), every request a *fresh* ~2,200-word prompt: a request number, then a fixed
  random-word text. The router's caches key every piece of a prompt by everything before
  it, so a new first piece makes the whole prompt new to the router (no cache hit, every
  block hash new), while the generator only glues a number to a string. The router
  tokenizes ~2,700 tokens, hashes ~170 blocks, looks them up and records them (in each
  worker's memory index by default; with the Redis index, Redis spends ~1 ms of its own CPU
  recording each such prompt, a third of a core at 300 req/s, which a 2-core machine takes
  from the workers): milliseconds of router CPU per request against a tenth of that for
  wrk and the fixed-answer backends together. This is the workload where the router's own
  CPU is the bottleneck, so the req/s of 1 vs 2 workers measures how the router scales,
  not how the machine's cores are shared with the generator.

wrk (C, epoll) is used when installed (``apt-get install wrk``); for ``router-bound`` its Lua
``request()`` builds each body.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from loadtest.bench_routing import WORDS

MODEL = "bench-model"
FRESH_WORDS = 2200
LIGHT_PROMPT = "hello world " * 40


@dataclass(frozen=True)
class Workload:
    name: str
    policy: str
    fresh: bool  # a new random prompt per request (else the fixed light prompt)
    describe: str


WORKLOADS = {
    "light": Workload("light", "round_robin", False, "round_robin, one fixed 480-char prompt"),
    "router-bound": Workload("router-bound", "cache_aware", True,
                             f"cache_aware + BPE tokenizer, a fresh {FRESH_WORDS}-word "
                             "(~2,700-token) prompt per request"),
}

_LIGHT_LUA = """
wrk.method = "POST"
wrk.body   = '{"model":"%(model)s","prompt":"%(prompt)s","max_tokens":1}'
wrk.headers["Content-Type"] = "application/json"
"""

_FRESH_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local text = "%(text)s"
local n = %(seed)d * 1000000000
request = function()
  n = n + 1
  local body = '{"model":"%(model)s","prompt":"request ' .. n .. ': ' .. text .. '","max_tokens":1}'
  return wrk.format(nil, nil, nil, body)
end
"""


def wrk_script(w: Workload, seed: int) -> str:
    if not w.fresh:
        return _LIGHT_LUA % {"model": MODEL, "prompt": LIGHT_PROMPT}
    return _FRESH_LUA % {"model": MODEL, "seed": seed, "text": fresh_prompt(random.Random(seed))}


def fresh_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) + (str(rng.randrange(100)) if rng.random() < 0.2 else "")
                    for _ in range(FRESH_WORDS))


def run_wrk(url: str, duration: float, connections: int, w: Workload,
            seed: int = 1) -> tuple[float, int, float]:
    """(req/s, non-2xx + socket errors, wrk CPU seconds) of one wrk run."""
    fd, name = tempfile.mkstemp(prefix="bench-scale-", suffix=".lua")
    os.close(fd)
    script = Path(name)
    script.write_text(wrk_script(w, seed))
    # --timeout 30s: a closed loop at saturation queues requests; one slower than wrk's default
    # 2 s is a slow answer, not an error
    proc = subprocess.Popen(["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--timeout", "30s",
                             "-s", str(script), url + "/v1/completions"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    _, _, ru = os.wait4(proc.pid, 0)
    proc.returncode = 0
    script.unlink()
    m = re.search(r"Requests/sec:\s*([0-9.]+)", out)
    if not m:
        raise RuntimeError(f"wrk output not understood:\n{out}")
    errs = sum(int(x) for x in re.findall(r"(?:Non-2xx or 3xx responses|connect|read|write|timeout)\s*:?\s*(\d+)",
                                           out.split("Socket errors")[-1] if "Socket errors" in out else ""))
    non2 = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", out)
    errs += int(non2.group(1)) if non2 else 0
    if errs:
        print("wrk reported errors:", " | ".join(line.strip() for line in out.splitlines()
                                                if "errors" in line or "Non-2xx" in line))
    return float(m.group(1)), errs, ru.ru_utime + ru.ru_stime


async def post_completion(s: Any, url: str, body: bytes) -> bool:
    """POST one completion body on an aiohttp session and read the answer; True on a 200."""
    import aiohttp

    try:
        async with s.post(url + "/v1/completions", data=body,
                          headers={"Content-Type": "application/json"}) as r:
            await r.read()
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def run_aiohttp(url: str, duration: float, connections: int, w: Workload,
                      seed: int = 1) -> tuple[float, int]:
    """(req/s, errors) of a closed loop of ``connections`` aiohttp clients in this process."""
    import aiohttp

    text = fresh_prompt(random.Random(seed))
    sent = seed * 1_000_000_000
    light = orjson.dumps({"model": MODEL, "prompt": LIGHT_PROMPT, "max_tokens": 1})
    done = errors = 0
    end = time.perf_counter() + duration
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections)) as s:
        async def worker() -> None:
            nonlocal done, errors, sent
            while time.perf_counter() < end:
                sent += 1
                body = orjson.dumps({"model": MODEL, "prompt": f"request {sent}: {text}", "max_tokens": 1}) \
                    if w.fresh else light
                ok = await post_completion(s, url, body)
                done += ok
                errors += not ok
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(connections)))
        wall = time.perf_counter() - t0
    return done / wall, errors
