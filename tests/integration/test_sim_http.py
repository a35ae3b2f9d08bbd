"""The simulated engine's HTTP surface over real sockets: OpenAI endpoints (with the real
`openai` client), streaming, tokenizer endpoints, SGLang-style info, errors, KV debug
endpoints, and cancellation when a client goes away."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from backends.engines import parse_load, parse_samples
from router.core import bytetok
from router.core.hashing import block_hashes, seed_hash

MODEL = "sim-8b"


@pytest.fixture(scope="module")
def sims(sim_factory_module):
    fast, scaled = sim_factory_module(1, model=MODEL, model_config="llama-3.1-8b", time_scale=0, seed=9)[0], \
        sim_factory_module(1, model=MODEL, model_config="llama-3.1-8b", time_scale=1)[0]
    return fast, scaled


@pytest.fixture
def url(sims):
    return sims[0].url


def oa(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=30, max_retries=0)


def test_completions_and_chat_with_openai_client(url):
    c = oa(url)
    r = c.completions.create(model=MODEL, prompt="Hello, simulated world", max_tokens=12)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].finish_reason == "length"
    assert len(r.choices[0].text) == 12 and r.choices[0].text.replace(" ", "").isalpha()
    assert r.usage.prompt_tokens == len("Hello, simulated world") and r.usage.completion_tokens == 12
    ch = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert ch.choices[0].message.role == "assistant" and len(ch.choices[0].message.content) == 5
    rendered = bytetok.render_chat([{"role": "user", "content": "hi"}])
    assert ch.usage.prompt_tokens == len(rendered)


def test_prompt_forms_text_list_ids_and_lists_of_ids(url):
    c = oa(url)
    r = c.completions.create(model=MODEL, prompt=["one", "two two"], max_tokens=3)
    assert sorted(ch.index for ch in r.choices) == [0, 1]
    assert r.usage.prompt_tokens == 3 + 7 and r.usage.completion_tokens == 6
    r = c.completions.create(model=MODEL, prompt=[104, 105, 33], max_tokens=2)
    assert r.usage.prompt_tokens == 3
    r = c.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=2)
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 5


def test_streaming_chat_and_completions_with_usage(url):
    c = oa(url)
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "stream"}],
                                            max_tokens=40, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len(text) == 40
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    parts = list(c.completions.create(model=MODEL, prompt="abc", max_tokens=7, stream=True))
    assert "".join(p.choices[0].text for p in parts) and all(p.usage is None for p in parts)


def test_raw_sse_framing_ends_with_done(url):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_output_deterministic_per_seed(url):
    c = oa(url)
    a = c.completions.create(model=MODEL, prompt="same", max_tokens=30).choices[0].text
    b = c.completions.create(model=MODEL, prompt="same", max_tokens=30).choices[0].text
    s = c.completions.create(model=MODEL, prompt="same", max_tokens=30, seed=123).choices[0].text
    assert a == b and a != s


def test_models_health_tokenize_detokenize_and_info(url):
    m = httpx.get(url + "/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == MODEL and m["data"][0]["max_model_len"] > 0
    assert httpx.get(url + "/health").status_code == 200
    t = httpx.post(url + "/tokenize", json={"prompt": "héllo"}).json()
    assert t["tokens"] == list("héllo".encode()) and t["count"] == 6
    t2 = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "a"}]}).json()
    assert t2["tokens"] == bytetok.encode(bytetok.render_chat([{"role": "user", "content": "a"}]))
    assert httpx.post(url + "/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "héllo"}
    info = httpx.get(url + "/server_info").json()
    assert info == httpx.get(url + "/get_server_info").json()
    assert info["page_size"] == 16 and info["max_total_num_tokens"] > 0
    load = httpx.get(url + "/get_load").json()
    assert load[0]["num_reqs"] == 0 and load[0]["num_waiting_reqs"] == 0


def test_render_endpoints_match_tokenize(url):
    msgs = [{"role": "user", "content": "render me"}]
    chat = httpx.post(url + "/v1/chat/completions/render", json={"model": MODEL, "messages": msgs}).json()
    tok = httpx.post(url + "/tokenize", json={"messages": msgs}).json()
    assert chat["token_ids"] == tok["tokens"]
    comp = httpx.post(url + "/v1/completions/render", json={"model": MODEL, "prompt": ["ab", "c"]}).json()
    assert comp == [{"token_ids": [97, 98]}, {"token_ids": [99]}]


def test_metrics_names_types_labels(url):
    oa(url).completions.create(model=MODEL, prompt="metrics please", max_tokens=3)
    resp = httpx.get(url + "/metrics")
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = resp.text
    for name, kind in [("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:prefix_cache_queries", "counter"),
                       ("vllm:prefix_cache_hits", "counter"), ("vllm:prompt_tokens", "counter"),
                       ("vllm:generation_tokens", "counter"), ("vllm:num_preemptions", "counter"),
                       ("vllm:spec_decode_num_drafts", "counter"), ("vllm:spec_decode_num_draft_tokens", "counter"),
                       ("vllm:spec_decode_num_accepted_tokens", "counter"),
                       ("vllm:time_to_first_token_seconds", "histogram"),
                       ("vllm:inter_token_latency_seconds", "histogram"),
                       ("vllm:e2e_request_latency_seconds", "histogram"), ("vllm:cache_config_info", "gauge")]:
        assert f"# TYPE {name} {kind}" in text, name
    gen = parse_samples(text, ("vllm:generation_tokens_total",))
    assert gen[0][1]["model_name"] == MODEL and gen[0][2] >= 3
    load = parse_load(text)
    assert load.engine == "vllm" and load.block_size == 16 and load.num_blocks > 1000
    assert 'vllm:e2e_request_latency_seconds_bucket{model_name="sim-8b",engine="0",le="+Inf"}' in text


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 200_000}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": 12}, 400, "prompt"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/chat/completions", [1, 2], 400, None),
    ("/tokenize", {"nothing": 1}, 400, "prompt"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/v1/nothing-here", {}, 404, None),
])
def test_openai_errors(url, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url + path, timeout=30, **kw)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    assert err["param"] == param


def test_kv_blocks_debug_and_reset_prefix_cache(url):
    httpx.post(url + "/reset_prefix_cache")
    prompt = "exact tracking " * 10  # 150 bytes: 9 full blocks
    c = oa(url)
    c.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    blocks = set(httpx.get(url + "/debug/kv_blocks").json())
    want = block_hashes(bytetok.encode(prompt), 16, seed_hash(MODEL))
    assert len(want) == 9 and set(want) <= blocks
    assert httpx.post(url + "/reset_prefix_cache").status_code == 200
    assert httpx.get(url + "/debug/kv_blocks").json() == []
    use = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage
    assert not use.prompt_tokens_details or not use.prompt_tokens_details.cached_tokens


def _running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(v for _, _, v in parse_samples(text, ("vllm:num_requests_running",)))


def _wait_running(url: str, want: float, timeout: float = 15.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = _running(url)
        if got == want:
            return got
        time.sleep(0.05)
    return _running(url)


def test_disconnected_stream_cancels_request(sims):
    url = sims[1].url  # real time: 3,000 tokens would take ~30 s
    body = {"model": MODEL, "prompt": "long one", "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        it = r.iter_lines()
        got = [next(it) for _ in range(4)]
        assert any(line.startswith("data: ") for line in got)
        assert _running(url) == 1
    assert _wait_running(url, 0) == 0


async def test_disconnected_non_streamed_request_cancels(sims):
    url = sims[1].url
    async with httpx.AsyncClient(timeout=0.5) as ac:
        with pytest.raises(httpx.TimeoutException):
            await ac.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3000})
    await asyncio.sleep(0)
    assert _wait_running(url, 0) == 0
    text = httpx.get(url + "/metrics").text
    aborted = [v for _, lab, v in parse_samples(text, ("vllm:request_success_total",))
               if lab.get("finished_reason") == "abort"]
    assert aborted and aborted[0] >= 1


async def test_a_failing_engine_step_errors_the_request_and_the_server_recovers():
    """In-process server on a real socket; the engine's step is made to fail once."""
    from aiohttp import web

    from backends.sim.cli import build_server
    from tests.support.services import free_port

    server, _ = build_server(["--model", MODEL, "--model-config", "llama-3.1-8b", "--time-scale", "0"])
    real_step = server.engine.step
    calls = {"n": 0}

    def flaky(now):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real_step(now)

    server.engine.step = flaky
    runner = web.AppRunner(server.make_app(), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as ac:
            r = await ac.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
            assert r.status_code == 500 and r.json()["error"]["code"] == 500
            r = await ac.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert server.engine_errors == 1 and server.engine.num_running == 0
    finally:
        await runner.cleanup()
