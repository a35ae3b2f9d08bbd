"""The compose stack (profile ``sim``) as plain processes: Redis, two routers, three sims.

There is no container engine here, so each service of docker-compose.yml is started as a
process with the command and environment the compose file gives it (the image's
entrypoint is ``kvrouter``). Only the network is translated, as a container network would:
every service gets a free port on 127.0.0.1, ``--host``/``--port`` of the sims and the
routers' ``listen`` follow it (``KVROUTER_LISTEN__*``), and ``service:port`` in the routers'
config file (mounted from config/compose/) becomes ``127.0.0.1:<its port>``.

Shown: both routers serve; a prompt placed by router-1 is found by router-2 (placement
shared through Redis); router-1 drains on SIGTERM — /ready fails at once, its in-flight
streams finish, new requests go to router-2 — and exits 0, with no request lost. A client
request refused at connect time (never received by router-1) is sent to router-2, as the
stack's nginx does (``proxy_next_upstream error``); router-1's own request log proves that
none of those had reached it and that everything it received got a 200.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai

from tests.e2e.test_deploy_files import Compose, image_env
from tests.support.services import Proc, RedisServer, free_port, http_ok, kvrouter_argv

PROMPT = "Compose topology check. A long instruction block shared by a conversation. " * 5


def translate_args(cmd: list[str], port: int) -> list[str]:
    out = list(cmd)
    for i, a in enumerate(out):
        if a == "--host":
            out[i + 1] = "127.0.0.1"
        elif a == "--port":
            out[i + 1] = str(port)
    return out


class Topology:
    def __init__(self, tmp: Path) -> None:
        self.c = Compose({"KVROUTER_ENGINES": "sim"})
        self.tmp = tmp
        self.redis: RedisServer | None = None
        self.procs: dict[str, Proc] = {}
        self.urls: dict[str, str] = {}
        self.addr: dict[str, str] = {}  # "service:port" -> "127.0.0.1:port"
        self.image_env = {k: v for k, v in image_env().items() if k.startswith("KVROUTER_")}  # the image's ENV

    def start(self) -> Topology:
        c = self.c
        assert c.services["redis"]["image"].startswith("redis:")
        self.redis = RedisServer().start()
        self.addr[f"redis:{c.listen_port('redis')}"] = f"127.0.0.1:{self.redis.port}"
        sims = c.by_subcommand("sim")
        for name in sims:
            port = free_port()
            self.addr[f"{name}:{c.listen_port(name)}"] = f"127.0.0.1:{port}"
            self.urls[name] = f"http://127.0.0.1:{port}"
            env = {**self.image_env, **c.env(name)}
            self.procs[name] = Proc(kvrouter_argv(*translate_args(c.command(name), port)), env=env)
            self.procs[name].start()
        for name in sims:
            self._wait(name, self.urls[name] + "/health")
        for name in c.by_subcommand("serve"):
            text = c.router_config_path(name).read_text()
            for svc, local in self.addr.items():
                text = text.replace(f"//{svc}", f"//{local}")
            assert not re.search(r"//(sim-\d|redis):", text), "an address was not translated"
            cfg = self.tmp / f"{name}.yaml"
            cfg.write_text(text)
            cmd = c.command(name)
            cmd[cmd.index("--config") + 1] = str(cfg)
            port = free_port()
            env = {**self.image_env, **c.env(name),
                   "KVROUTER_LISTEN__HOST": "127.0.0.1", "KVROUTER_LISTEN__PORT": str(port)}
            self.urls[name] = f"http://127.0.0.1:{port}"
            self.procs[name] = Proc(kvrouter_argv(*cmd), env=env, log=self.tmp / f"{name}.log")
            self.procs[name].start()
        for name in c.by_subcommand("serve"):
            self._wait(name, self.urls[name] + "/ready")
        return self

    def _wait(self, name: str, url: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        proc = self.procs[name]
        while not http_ok(url):
            assert proc.proc is not None
            if proc.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready:\n{proc.log()}")
            time.sleep(0.1)

    def stop(self) -> None:
        for p in self.procs.values():
            p.stop()
        if self.redis:
            self.redis.stop()


class Clients:
    """Streaming traffic over both routers with nginx's failover rule (connect failures only)."""

    def __init__(self, urls: list[str], model: str) -> None:
        self.clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key="none", max_retries=0, timeout=60)
                        for u in urls]
        self.model = model
        self.done: list[tuple[str, int, float, float]] = []  # request id, router index, start, end
        self.refused: list[tuple[str, int, str]] = []  # connect-time failures, resent to the other router
        self.errors: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, workers: int) -> None:
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(workers)]

    async def _worker(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            rid = f"w{i}-{n}"
            first = (i + n) % 2
            for r in (first, 1 - first):
                t0 = time.monotonic()
                try:
                    stream = await self.clients[r].completions.create(
                        model=self.model, prompt=f"{rid} {PROMPT}", max_tokens=64, stream=True,
                        extra_headers={"x-request-id": rid})
                except openai.APIConnectionError as exc:  # never received: nginx would resend it
                    self.refused.append((rid, r, type(exc.__cause__ or exc).__name__))
                    continue
                except Exception as exc:
                    self.errors.append(f"{rid} on {r}: {type(exc).__name__}: {exc}")
                    break
                try:
                    chunks = [ch async for ch in stream]
                    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
                    self.done.append((rid, r, t0, time.monotonic()))
                except Exception as exc:  # broken after it started: a lost request
                    self.errors.append(f"{rid} on {r} mid-stream: {type(exc).__name__}: {exc}")
                break
            else:
                self.errors.append(f"{rid}: refused by both routers")

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        for c in self.clients:
            await c.close()


def request_log(path: Path) -> dict[str, int]:
    """request id -> status, from a router's JSON request lines."""
    out: dict[str, int] = {}
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"request_id"' in line:
            rec: dict[str, Any] = json.loads(line)
            out[str(rec["request_id"])] = int(rec["status"])
    return out


async def test_compose_topology_serves_shares_placement_and_drains(tmp_path: Path):
    topo = Topology(tmp_path).start()
    try:
        c = topo.c
        r1, r2 = c.by_subcommand("serve")
        model = c.router_config(r1).model_names()[0]
        admin = c.env(r1)["KVROUTER_AUTH__ADMIN_KEY"]
        assert admin == c.env(r2)["KVROUTER_AUTH__ADMIN_KEY"]
        urls = [topo.urls[r1], topo.urls[r2]]
        clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key="none", max_retries=0) for u in urls]

        # both routers serve
        for cl in clients:
            for i in range(3):
                comp = await cl.completions.create(model=model, prompt=f"hello {i}", max_tokens=4)
                assert comp.choices[0].text

        # placement made by router-1 is seen by router-2 (shared Redis index)
        placed: dict[str, str] = {}
        for k in range(6):
            prompt = f"conversation {k}: {PROMPT}"
            raw = await clients[0].completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=2)
            placed[prompt] = raw.headers["x-kvrouter-replica"]
        assert len(set(placed.values())) >= 2, placed  # spread over the sims, not one by chance
        # router-1's index writes are batched off the request path: wait until they land
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {admin}"}) as s:
            deadline = time.monotonic() + 20
            for prompt, replica in placed.items():
                while True:
                    async with s.post(urls[1] + "/debug/route", json={"model": model, "prompt": prompt}) as r:
                        d = await r.json()
                    if d["matched_blocks"] > 0 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)
                assert d["replica"] == replica and d["matched_blocks"] > 0, (replica, d)
        for prompt, replica in list(placed.items())[:3]:
            raw = await clients[1].completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=2)
            assert raw.headers["x-kvrouter-replica"] == replica
        for cl in clients:
            await cl.close()

        # router-1 drains on SIGTERM while streams flow through both routers
        traffic = Clients(urls, model)
        traffic.start(workers=6)
        deadline = time.monotonic() + 30
        while sum(1 for _, r, _, _ in traffic.done if r == 0) < 6 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        t_sig = time.monotonic()
        topo.procs[r1].signal(signal.SIGTERM)
        async with aiohttp.ClientSession() as s:
            # the signal is handled asynchronously: /ready turns 503 within moments, not at once
            ready_deadline = time.monotonic() + 10
            while True:
                async with s.get(urls[0] + "/ready") as r:
                    status, body = r.status, await r.json()
                if status == 503 or time.monotonic() > ready_deadline:
                    break
                await asyncio.sleep(0.02)
            assert status == 503 and body["draining"] is True
            async with s.get(urls[1] + "/ready") as r:
                assert r.status == 200
        drain_delay = c.router_config(r1).lifecycle.drain_delay_s
        await asyncio.sleep(drain_delay + 3.0)
        await traffic.stop()
        proc = topo.procs[r1].proc
        assert proc is not None
        code = await asyncio.to_thread(proc.wait, 60)
        assert code == 0, topo.procs[r1].log()
    finally:
        topo.stop()

    assert traffic.errors == [], traffic.errors[:5]
    on_r1 = [d for d in traffic.done if d[1] == 0]
    in_flight_at_sigterm = [d for d in on_r1 if d[2] < t_sig < d[3]]
    assert in_flight_at_sigterm, "no stream was in flight on router-1 when it got SIGTERM"
    after = [d for d in traffic.done if d[2] > t_sig + drain_delay + 0.5]
    assert after and all(r == 1 for _, r, _, _ in after), "after the drain delay router-2 serves everything"
    log1 = request_log(tmp_path / f"{r1}.log")
    assert log1, "router-1 logged its requests"
    assert {rid: st for rid, st in log1.items() if st != 200} == {}, "router-1 answered everything it took"
    assert all(rid in log1 for rid, _, _, _ in on_r1)
    never_received = [rid for rid, r, _ in traffic.refused if r == 0]
    assert not [rid for rid in never_received if rid in log1], "a refused request had reached router-1"
    assert "drained; exiting" in (tmp_path / f"{r1}.log").read_text()
