"""``kvrouter replay --prompt-mode auto`` (the default): one token-id prompt is sent first;
token ids are used when the target accepts it (the simulator does), text when it does not (a
strict server, here a small aiohttp app on loopback that rejects token-id prompts)."""

from __future__ import annotations

import orjson
import pytest
from aiohttp import web

from loadtest import replay_cli
from loadtest.live import PROBE_TOKEN_IDS, LiveOptions, replay_live
from loadtest.traces.generators import multi_turn

MODEL = "llama-3.1-8b"


def trace():
    return multi_turn(n_sessions=2, turns=(2, 2), rate=50.0, think_time_s=(0.01, 0.02), system_blocks=(2, 3),
                      turn_blocks=(1, 2), output=(2, 3), block_size=16, seed=3)


def test_cli_default_is_auto():
    args = replay_cli.build_parser().parse_args(["t.jsonl", "--target", "http://127.0.0.1:1"])
    assert args.prompt_mode == "auto"


async def test_auto_uses_token_ids_on_a_target_that_accepts_them(sim_factory):
    (sim,) = sim_factory(1, model=MODEL)
    reqs = trace()
    res = await replay_live(reqs, LiveOptions(target=sim.url, speed=20.0, prompt_mode="auto"))
    assert res.summary["prompt_mode"] == "tokens"
    assert res.summary["ok"] == len(reqs)
    assert [r["prompt_tokens"] for r in res.records] == [t.input_length for t in reqs]
    chat = await replay_live(reqs[:2], LiveOptions(target=sim.url, speed=20.0, endpoint="chat", prompt_mode="auto"))
    assert chat.summary["prompt_mode"] == "text" and chat.summary["ok"] == 2


@pytest.fixture
async def strict_server():
    """An OpenAI-like server that rejects token-id prompts with a 400 and streams one token."""
    seen: list[object] = []

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body.get("prompt"))
        if not isinstance(body.get("prompt"), str):
            return web.json_response({"error": {"message": "prompt must be a string", "type": "invalid_request_error",
                                                "param": "prompt", "code": None}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1}}
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\ndata: " + orjson.dumps(usage)
                         + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_auto_falls_back_to_text_when_token_ids_are_rejected(strict_server):
    url, seen = strict_server
    reqs = trace()[:3]
    res = await replay_live(reqs, LiveOptions(target=url, speed=20.0, vllm_extensions=False,
                                              prompt_mode="auto"))
    assert res.summary["prompt_mode"] == "text"
    assert res.summary["ok"] == 3 and not res.summary["errors"]
    assert seen[0] == PROBE_TOKEN_IDS  # the probe, then text prompts only
    assert len(seen) == 4 and all(isinstance(p, str) for p in seen[1:])
