"""``kvrouter serve`` and ``kvrouter config check`` as processes: config from a file, a
``KVROUTER_*`` environment override and a ``--set`` flag; a bad config exits 2 naming the
key; SIGTERM exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

from tests.support.services import ROOT, Proc, free_port, kvrouter_argv

MODEL = "llama-3.1-8b"


def test_serve_file_env_and_flags(sim_factory, tmp_path):
    (sim,) = sim_factory(1, time_scale=0, model=MODEL)
    port = free_port()
    cfg = tmp_path / "router.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: 1}}\npolicy: {{name: round_robin}}\n"
                   f"replicas:\n  - {{id: only, url: '{sim.url}', models: [{MODEL}]}}\n")
    proc = Proc(kvrouter_argv("serve", "--config", str(cfg), "--set", "headers.replica_header=x-served-by"),
                ready_url=f"http://127.0.0.1:{port}/ready",
                env={"KVROUTER_LISTEN__PORT": str(port), "KVROUTER_LOGGING__FORMAT": "json"}).start(timeout=60)
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                     data=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200 and r.headers["x-served-by"] == "only"
            assert json.loads(r.read())["usage"]["completion_tokens"] == 2
        proc.signal(signal.SIGTERM)
        assert proc.proc is not None and proc.proc.wait(40) == 0
        lines = [json.loads(x) for x in proc.log().splitlines() if x.startswith("{")]
        assert any(x.get("replica") == "only" and x.get("status") == 200 for x in lines)
    finally:
        proc.stop()


def test_bad_config_exits_2_naming_the_key(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("replicas:\n  - {url: 'http://127.0.0.1:1', models: [m]}\n  - {url: 'localhost', models: [m]}\n")
    r = subprocess.run(kvrouter_argv("serve", "--config", str(cfg)), capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert r.returncode == 2 and "replicas[1].url: must be http(s)://host:port" in r.stderr
    r = subprocess.run(kvrouter_argv("config", "check", str(cfg)), capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert r.returncode == 1 and "replicas[1].url" in r.stderr
    r = subprocess.run(kvrouter_argv("config", "check", str(ROOT / "config" / "router.yaml")), capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "router.cli", "serve", "--policy", "nope", "--replica",
                        "http://127.0.0.1:1=m"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "policy.name" in r.stderr
