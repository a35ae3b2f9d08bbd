"""SIGHUP reload of a real ``kvrouter serve`` process, with streams flowing the whole time.

Three ``kvrouter sim`` engines, the router as a child process, the real ``openai`` client.
A reload changes the policy weights (seen in ``POST /debug/route`` scores), adds a replica
(probed, then used) and later the client keys; an invalid file is refused with a log line
and the old config keeps serving; not one request fails; SIGTERM then exits 0.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import aiohttp
import openai
import yaml

from tests.support.services import Proc, free_port, kvrouter_argv
from tests.support.sim import sim_factory  # noqa: F401 - fixture

MODEL = "llama-3.1-8b"
ADMIN = "admin-key"
KEY = "client-key-1"
PROMPT = "Reload test: a long shared instruction block that the router hashes into blocks. " * 6


def router_config(sims: list[Any], n: int, hit_weight: float, api_keys: list[str] | None = None) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1"},
        "policy": {"name": "cache_aware", "options": {"hit_weight": hit_weight}},
        "models": {MODEL: {"tokenizer": "builtin", "block_size": 16}},
        "replicas": [{"id": f"s{i}", "url": s.url, "models": [MODEL]} for i, s in enumerate(sims[:n])],
        "health": {"interval_s": 0.5, "timeout_s": 2.0},
        "scrape": {"interval_s": 0.5},
        "auth": {"admin_key": ADMIN, "api_keys": api_keys or []},
        "logging": {"requests": False},
    }


async def wait_for(cond: Any, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await cond():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.1)


class Admin:
    def __init__(self, url: str) -> None:
        self.url = url
        self.s = aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"})

    async def replicas(self) -> list[dict[str, Any]]:
        async with self.s.get(self.url + "/admin/replicas") as r:
            return list((await r.json())["replicas"])

    async def route(self, prompt: str) -> dict[str, Any]:
        async with self.s.post(self.url + "/debug/route", json={"model": MODEL, "prompt": prompt}) as r:
            assert r.status == 200, await r.text()
            return dict(await r.json())

    async def metric(self, name: str) -> float:
        async with self.s.get(self.url + "/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return -1.0


class Streams:
    """Concurrent streaming completions until stopped; every failure is a lost request."""

    def __init__(self, url: str, workers: int = 4) -> None:
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        self.ok = 0
        self.errors: list[str] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._run(i)) for i in range(workers)]

    async def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                stream = await self.client.completions.create(model=MODEL, prompt=f"{i}.{n} {PROMPT}",
                                                              max_tokens=24, stream=True)
                chunks = [c async for c in stream]
                assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
                self.ok += 1
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self.client.close()


async def test_sighup_reload_weights_replicas_keys_and_invalid_file(sim_factory, tmp_path: Path):  # noqa: F811
    sims = sim_factory(3, time_scale=1, num_blocks=2000, model=MODEL)
    cfg_path = tmp_path / "router.yaml"
    cfg_path.write_text(yaml.safe_dump(router_config(sims, 2, hit_weight=1.0)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = Proc(kvrouter_argv("serve", "--config", str(cfg_path), "--port", str(port)),
                  ready_url=url + "/ready").start(timeout=60)
    admin = Admin(url)
    streams = Streams(url)
    try:
        async def served(n: int) -> bool:
            return streams.ok >= n

        await wait_for(lambda: served(8))
        # a prompt placed on some replica: with hit_weight 1 its score carries the match
        probe = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        raw = await probe.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        placed = raw.headers["x-kvrouter-replica"]
        await probe.close()
        before = await admin.route(PROMPT)
        score = {r["id"]: r["score"] for r in before["replicas"]}
        assert before["matched_blocks"] > 0 and score[placed] > 0.5, before

        # reload 1: weights change and a third replica joins
        cfg_path.write_text(yaml.safe_dump(router_config(sims, 3, hit_weight=0.0)))
        router.signal(signal.SIGHUP)

        async def reloaded(n: float) -> bool:
            return await admin.metric("kvrouter_config_reloads_total") >= n

        await wait_for(lambda: reloaded(1))
        after = await admin.route(PROMPT)
        score = {r["id"]: r["score"] for r in after["replicas"]}
        matched = {r["id"]: r["matched_blocks"] for r in after["replicas"]}
        assert matched[placed] > 0 and score[placed] < 0.1, after

        async def three_healthy() -> bool:
            reps = await admin.replicas()
            return len(reps) == 3 and all(r["healthy"] for r in reps)

        await wait_for(three_healthy)

        # reload 2: an invalid file is refused; the running config stays
        bad = router_config(sims, 1, hit_weight=1.0)
        bad["upstream"] = {"max_retries": -1}
        cfg_path.write_text(yaml.safe_dump(bad))
        router.signal(signal.SIGHUP)

        async def refused() -> bool:
            return await admin.metric("kvrouter_config_reload_failures_total") >= 1

        await wait_for(refused)
        assert "config reload refused: upstream.max_retries" in router.log()
        assert len(await admin.replicas()) == 3
        score = {r["id"]: r["score"] for r in (await admin.route(PROMPT))["replicas"]}
        assert score[placed] < 0.1
        cfg_path.write_text("policy: [not, a, mapping\n")  # not even YAML
        router.signal(signal.SIGHUP)

        async def refused_twice() -> bool:
            return await admin.metric("kvrouter_config_reload_failures_total") >= 2

        await wait_for(refused_twice)
        assert await admin.metric("kvrouter_config_reloads_total") == 1

        # reload 3: client keys; the streams already send KEY
        cfg_path.write_text(yaml.safe_dump(router_config(sims, 3, hit_weight=0.0, api_keys=[KEY])))
        router.signal(signal.SIGHUP)
        await wait_for(lambda: reloaded(2))
        async with aiohttp.ClientSession() as s, \
                s.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}) as r:
            assert r.status == 401
            err = json.loads(await r.text())["error"]
            assert err["code"] == "invalid_api_key" and set(err) >= {"message", "type", "param", "code"}
        mark = streams.ok
        await wait_for(lambda: served(mark + 8))
    finally:
        await streams.stop()
        await admin.s.close()
        code = router.stop(timeout=40)
    # streams served before the reloads (served(8)) and after the last one (served(mark + 8)),
    # and none failed across them
    assert streams.errors == [], streams.errors[:5]
    assert code == 0, router.log()


async def test_config_file_change_is_reloaded_without_a_signal(sim_factory, tmp_path: Path):  # noqa: F811
    sims = sim_factory(2, time_scale=0, model=MODEL)
    cfg = router_config(sims, 1, hit_weight=1.0)
    cfg["lifecycle"] = {"watch_config_s": 0.3}
    cfg_path = tmp_path / "router.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = Proc(kvrouter_argv("serve", "--config", str(cfg_path), "--port", str(port)),
                  ready_url=url + "/ready").start(timeout=60)
    admin = Admin(url)
    try:
        assert len(await admin.replicas()) == 1
        cfg = router_config(sims, 2, hit_weight=1.0)
        cfg["lifecycle"] = {"watch_config_s": 0.3}
        cfg_path.write_text(yaml.safe_dump(cfg))

        async def two() -> bool:
            return len(await admin.replicas()) == 2

        async def reloaded() -> bool:
            return await admin.metric("kvrouter_config_reloads_total") == 1

        await wait_for(two)
        await wait_for(reloaded)  # counted just after the new replicas are applied
        assert "config file" in router.log() and "changed: reloading" in router.log()
    finally:
        await admin.s.close()
        code = router.stop(timeout=40)
    assert code == 0
