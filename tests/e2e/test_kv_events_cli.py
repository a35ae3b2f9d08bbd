"""``kvrouter events`` as a process: a simulated engine publishes, the consumer writes the shared
Redis index, another client reads it; config errors exit 2 with a message."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from router.core.hashing import block_hashes, seed_hash
from router.index.redis import RedisIndex
from tests.support.services import Proc, free_port, kvrouter_argv
from tests.support.sim import SimHandle

MODEL = "sim-model"


def write_config(tmp: Path, data: dict) -> str:
    p = tmp / "router.yaml"
    p.write_text(yaml.safe_dump(data))
    return str(p)


async def test_events_command_feeds_redis(redis_url, tmp_path):
    d = Path(tempfile.mkdtemp(prefix="kvr-cli-ev-"))
    ev = {"endpoint": f"ipc://{d}/pub", "replay_endpoint": f"ipc://{d}/replay", "topic": ""}
    sim = SimHandle(model=MODEL, block_size=16, num_blocks=256, kv_events_config=json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", **ev})).start()
    mport = free_port()
    cfg = write_config(tmp_path, {
        "models": {MODEL: {"block_size": 16}},
        "index": {"backend": "redis", "url": redis_url, "namespace": "evcli"},
        "replicas": [{"id": "e0", "url": sim.url, "models": [MODEL], "kv_events": ev}],
    })
    proc = Proc(kvrouter_argv("events", "--config", cfg, "--metrics-port", str(mport)),
                ready_url=f"http://127.0.0.1:{mport}/metrics").start()
    reader = RedisIndex(redis_url, namespace="evcli")
    await reader.start()
    try:
        text = "the consumer indexes what the engine stores " * 8
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(sim.url + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 2})
            assert r.status_code == 200
            toks = (await c.post(sim.url + "/tokenize", json={"model": MODEL, "prompt": text})).json()["tokens"]
            hashes = block_hashes(toks, 16, seed_hash(MODEL))
            deadline = time.monotonic() + 20
            while (await reader.lookup(MODEL, hashes)).get("e0", 0) != len(hashes):
                assert time.monotonic() < deadline, proc.log()
                await asyncio.sleep(0.1)
            metrics = (await c.get(f"http://127.0.0.1:{mport}/metrics")).text
            assert 'kvrouter_kv_events_received_total{replica="e0",type="BlockStored"}' in metrics
            # the engine drops its cache: the shared index follows
            assert (await c.post(sim.url + "/reset_prefix_cache")).status_code == 200
            deadline = time.monotonic() + 20
            while (await reader.lookup(MODEL, hashes)).get("e0", 0) != 0:
                assert time.monotonic() < deadline, proc.log()
                await asyncio.sleep(0.1)
    finally:
        await reader.close()
        assert proc.stop() == 0, proc.log()
        sim.stop()


def test_events_command_config_errors(tmp_path):
    import subprocess

    base = {"replicas": [{"id": "e0", "url": "http://127.0.0.1:1", "models": [MODEL]}]}
    cfg = write_config(tmp_path, base)
    r = subprocess.run(kvrouter_argv("events", "--config", cfg), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no replica has kv_events" in r.stderr
    base["replicas"][0]["kv_events"] = {"endpoint": "tcp://127.0.0.1:5999"}
    cfg = write_config(tmp_path, base)
    r = subprocess.run(kvrouter_argv("events", "--config", cfg), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "index.backend" in r.stderr
    base["replicas"][0]["kv_events"] = {"endpoint": "http://nope"}
    cfg = write_config(tmp_path, base)
    r = subprocess.run(kvrouter_argv("events", "--config", cfg), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "kv_events.endpoint" in r.stderr


def test_events_command_refuses_bad_numbers(tmp_path, capsys):
    """A non-positive replay timeout (every replay would fail) or an impossible port is a usage
    error: exit 2 naming the option, before anything starts."""
    from router.events_cli import main

    cfg = write_config(tmp_path, {"replicas": []})
    for args, needle in ((["--replay-timeout", "-1"], "--replay-timeout: must be a positive number"),
                         (["--replay-timeout=0"], "--replay-timeout: must be a positive number"),
                         (["--replay-timeout", "nan"], "--replay-timeout: must be a positive number"),
                         (["--replay-timeout", "soon"], "--replay-timeout: 'soon' is not a number"),
                         (["--metrics-port", "70000"], "--metrics-port: must be a port number")):
        with pytest.raises(SystemExit) as exc:
            main(["--config", cfg, *args])
        assert exc.value.code == 2, args
        assert needle in capsys.readouterr().err, args
