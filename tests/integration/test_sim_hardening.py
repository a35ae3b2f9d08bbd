"""`kvrouter sim` hardening: malformed HTTP (and an HTTP/2 preface, as sglang-router probes
with) gets an OpenAI-shaped JSON 400 and one log line without a traceback; numeric flags are
validated naming the flag; chat messages without a role or with a non-string content are a
400, as in vLLM."""

from __future__ import annotations

import socket
import time

import httpx
import orjson
import pytest

from backends.sim.cli import build_server


def _raw(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes and read the whole answer (the server closes after a protocol error)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                b = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not b:
                break
            chunks.append(b)
    return b"".join(chunks)


def _status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"application/json" in head.lower(), head
    return status, orjson.loads(body)


@pytest.mark.parametrize("payload", [
    b"GARBAGE\x01\x02 / HTTP/1.1\r\n\r\n",  # a bad request line
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # the HTTP/2 connection preface
    b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",  # a header without a colon
])
def test_malformed_http_gets_a_json_400_and_no_traceback(sim_factory, payload):
    (sim,) = sim_factory(1, log_level="info")
    status, body = _status_and_json(_raw(sim.port, payload))
    assert status == 400
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
    assert err["message"].startswith("Malformed HTTP request")
    # the engine still serves, and logged one line for it, without a traceback
    assert httpx.get(sim.url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 10
    while "malformed HTTP request" not in sim.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = sim.log()
    assert "malformed HTTP request" in log
    assert "Traceback" not in log and "ERROR" not in log


@pytest.fixture(scope="module")
def chat_sim(sim_factory_module):
    return sim_factory_module(1)[0]


@pytest.mark.parametrize("message,needle", [
    ({"content": "hi"}, "role"),
    ({"role": 5, "content": "hi"}, "role"),
    ({"role": "user", "content": 5}, "content"),
    ({"role": "user", "content": {"text": "hi"}}, "content"),
    ({"role": "user", "content": [5]}, "content part"),
])
def test_bad_chat_messages_are_a_400(chat_sim, message, needle):
    sims = [chat_sim]
    body = {"model": "llama-3.1-8b", "max_tokens": 2, "messages": [message]}
    for path in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(sims[0].url + path, json=body, timeout=30)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert needle in err["message"] and err["param"] == "messages"
    ok = {"model": "llama-3.1-8b", "max_tokens": 2,
          "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                       {"role": "assistant", "content": None}, {"role": "user", "content": "more"}]}
    assert httpx.post(sims[0].url + "/v1/chat/completions", json=ok, timeout=30).status_code == 200


@pytest.mark.parametrize("argv,needle", [
    (["--num-blocks", "-5"], "--num-blocks must be >= 1, got -5"),
    (["--num-blocks", "0"], "--num-blocks must be >= 1"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--tensor-parallel", "0"], "--tensor-parallel must be >= 1"),
    (["--max-model-len", "1"], "--max-model-len must be >= 2"),
    (["--default-max-tokens", "-1"], "--default-max-tokens must be >= 0"),
    (["--port", "70000"], "--port must be <= 65535"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
])
def test_numeric_flags_are_validated_naming_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        build_server(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "does not fit" not in err
