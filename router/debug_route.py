"""``POST /debug/route`` (admin): the routing decision for a request, without sending it.

The body is the OpenAI request body (``messages`` → chat, else ``prompt`` → completions;
``?path=/v1/...`` forces one). The answer names the replica the router would pick, the
reason, the prompt's token and block counts, and per replica its load, matched blocks and
score. Nothing is recorded in the index and no replica is contacted. A prompt that cannot
be read (``"prompt": 5``, no ``messages``) is a 400 ``invalid_prompt``, as an engine would
answer the proxied request.
"""

from __future__ import annotations

import random
from typing import Any

import orjson
from aiohttp import web

from router.core.types import NoReplicaError, RoutingRequest


def _token_ids(v: Any) -> bool:
    return isinstance(v, list) and all(type(t) is int for t in v)


def prompt_problem(path: str, body: dict[str, Any]) -> tuple[str, str] | None:
    """(param, message) when the body's prompt cannot be read as OpenAI's API defines it
    (``prompt``: a string, strings, token ids or lists of token ids; ``messages``: a
    non-empty list of objects with a string ``role``); None when it can."""
    if path == "/v1/chat/completions":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "messages", "'messages' must be a non-empty array of message objects"
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return f"messages[{i}]", f"messages[{i}] must be an object with a string 'role'"
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt) or _token_ids(prompt)
                                                or all(_token_ids(p) and len(p) > 0 for p in prompt)):
        return None
    return "prompt", ("'prompt' must be a string, an array of strings, an array of token ids or an "
                      "array of token-id arrays")


async def handle_debug_route(request: web.Request) -> web.Response:
    from router.admin import admin_json
    from router.server import _err

    got = await admin_json(request)
    if isinstance(got, web.Response):
        return got
    st, body = got
    path = request.query.get("path") or ("/v1/chat/completions" if "messages" in body else "/v1/completions")
    if path not in ("/v1/chat/completions", "/v1/completions"):
        return _err(400, "path must be /v1/chat/completions or /v1/completions", "invalid_request_error",
                    "invalid_path", param="path")
    model = body.get("model")
    if model is None and len(st.configured_models) == 1:
        model = st.configured_models[0]
    if not isinstance(model, str):
        return _err(400, "The 'model' field is required and must be a string", "invalid_request_error",
                    "missing_model", param="model")
    if not st.pool.has_model(model):
        return _err(404, f"The model `{model}` does not exist", "invalid_request_error", "model_not_found",
                    param="model")
    if (bad := prompt_problem(path, body)) is not None:
        return _err(400, bad[1], "invalid_request_error", "invalid_prompt", param=bad[0])
    session_key = request.headers.get(st.session_header)
    if session_key is None and isinstance(body.get("user"), str) and body["user"]:
        session_key = body["user"]
    req = RoutingRequest(model=model, session_key=session_key, request_id="debug")
    proxy = st.proxy
    matches: dict[str, int] = {}
    if proxy.needs_prefix:
        await proxy.prefix.annotate(path, body, req)
        matches = await proxy.prefix.lookup(req)
    snapshot = st.pool.snapshot(model)
    try:
        d = proxy.policy.choose(req, snapshot, matches, random.Random(0))
    except NoReplicaError as exc:
        return _err(503, str(exc), "service_unavailable", "no_healthy_replica")
    replicas: list[dict[str, Any]] = [
        {"id": r.id, "healthy": r.healthy, "load": r.load, "in_flight": r.in_flight, "running": r.running,
         "waiting": r.waiting, "kv_usage": r.kv_usage, "matched_blocks": matches.get(r.id, 0),
         "score": d.scores.get(r.id)} for r in snapshot]
    out = {"replica": d.replica, "reason": d.reason, "policy": d.policy, "path": path, "model": model,
           "num_tokens": req.num_tokens, "block_size": req.block_size, "blocks": len(req.hashes),
           "matched_blocks": d.matched_blocks, "matched_tokens": d.matched_tokens, "replicas": replicas}
    return web.Response(body=orjson.dumps(out), content_type="application/json")
