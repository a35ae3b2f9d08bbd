"""``kvrouter up`` end to end: the official ``openai`` client, sync and async, completions
and chat, streaming and not, and a token-id prompt, unchanged against the router; Ctrl-C
stops the router and every simulated engine it started."""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import openai
import pytest

from tests.support.services import Proc, free_port, http_ok, kvrouter_argv

MODEL = "llama-3.1-8b"


@pytest.fixture(scope="module")
def up():
    port = free_port()
    proc = Proc(kvrouter_argv("up", "--port", str(port), "--replicas", "2", "--time-scale", "0",
                              "--policy", "round_robin"),
                ready_url=f"http://127.0.0.1:{port}/ready")
    proc.start(timeout=90)
    yield proc, f"http://127.0.0.1:{port}"
    proc.stop()


def test_banner_prints_endpoint_and_examples(up):
    proc, url = up
    deadline = time.monotonic() + 10
    while "python -c" not in proc.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = proc.log()
    assert f"router on {url}" in log
    assert f"curl -s {url}/v1/completions" in log
    assert f"OpenAI(base_url='{url}/v1'" in log
    # the printed examples work as printed
    py_line = next(line.strip() for line in log.splitlines() if line.strip().startswith("python -c"))
    code = shlex.split(py_line)[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr
    curl = shutil.which("curl")
    if curl:
        curl_line = next(line.strip() for line in log.splitlines() if line.strip().startswith("curl "))
        out = subprocess.run([curl, *shlex.split(curl_line)[1:]], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and '"choices"' in out.stdout


def test_sync_client_completions_and_chat(up):
    _, url = up
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    assert [m.id for m in c.models.list()] == [MODEL]
    r = c.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=5)
    assert r.choices[0].text and r.usage.completion_tokens == 5
    r2 = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r2.choices[0].message.role == "assistant" and r2.choices[0].message.content
    # a raw response names the replica that served
    raw = c.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=1)
    assert raw.headers["x-kvrouter-replica"] in ("sim0", "sim1") and raw.headers["x-request-id"]


def test_sync_client_streams(up):
    _, url = up
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    chunks = list(c.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, stream=True))
    assert sum(len(ch.choices) for ch in chunks) >= 1
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


def test_token_id_prompt(up):
    _, url = up
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    r = c.completions.create(model=MODEL, prompt=[101, 2023, 2003, 1037, 3231, 102] * 4, max_tokens=3)
    assert r.usage.prompt_tokens == 24 and r.choices[0].text


async def test_async_client(up):
    _, url = up
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    r = await c.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert r.choices[0].text
    r2 = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r2.choices[0].message.content
    stream = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "yo"}],
                                             max_tokens=4, stream=True)
    parts = [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
    assert "".join(parts)
    stream = await c.completions.create(model=MODEL, prompt="yo", max_tokens=4, stream=True)
    assert "".join([ch.choices[0].text async for ch in stream if ch.choices])
    await c.close()


def test_unknown_model_is_an_openai_not_found(up):
    _, url = up
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"


def test_ctrl_c_stops_everything():
    port = free_port()
    proc = Proc(kvrouter_argv("up", "--replicas", "2", "--time-scale", "0"),  # port from the environment
                ready_url=f"http://127.0.0.1:{port}/ready", env={"KVROUTER_LISTEN__PORT": str(port)}).start(timeout=90)
    sims = re.findall(r"simulated engines: (.*)\)", proc.log())
    deadline = time.monotonic() + 10
    while not sims and time.monotonic() < deadline:
        time.sleep(0.1)
        sims = re.findall(r"simulated engines: (.*)\)", proc.log())
    urls = sims[0].split(", ")
    assert len(urls) == 2 and all(http_ok(u + "/health") for u in urls)
    proc.signal(signal.SIGINT)
    assert proc.proc is not None
    assert proc.proc.wait(20) == 0
    assert not http_ok(f"http://127.0.0.1:{port}/health")
    assert not any(http_ok(u + "/health") for u in urls)
