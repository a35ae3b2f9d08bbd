"""The admin API (``/admin/replicas``: list, add, remove replicas at run time), behind
``auth.admin_key`` (403 when unset, 401 on a wrong key). The handlers are registered by
:func:`router.server.build_app`; documented in ``docs/router.md``.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from router.config import ConfigError
from router.pool import replica_from_dict, states_summary
from router.server import STATE, RouterState, _err, _unauthorized, read_body


def admin_guard(st: RouterState, request: web.Request) -> web.Response | None:
    if st._admin is None:
        return _err(403, "The admin API is disabled (set auth.admin_key)", "permission_error", "admin_disabled")
    if not st.admin_ok(request):
        return _unauthorized()
    return None


async def admin_json(request: web.Request) -> tuple[RouterState, dict[str, Any]] | web.Response:
    """The admin key checked, then the body read like the proxy's (size limit, gzip/deflate)
    and parsed as a JSON object; an OpenAI-style 4xx error otherwise."""
    st = request.app[STATE]
    if (denied := admin_guard(st, request)) is not None:
        return denied
    raw = await read_body(request, st)
    if isinstance(raw, web.Response):
        return raw
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return _err(400, f"Request body is not valid JSON: {exc}", "invalid_request_error", "invalid_json")
    if not isinstance(body, dict):
        return _err(400, "Request body must be a JSON object", "invalid_request_error", "invalid_json")
    return st, body


async def handle_admin_list(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if (denied := admin_guard(st, request)) is not None:
        return denied
    reps = []
    for r, s in zip(st.pool.replicas(), states_summary([r.state for r in st.pool.replicas()]), strict=True):
        s.update(last_error=r.last_error, ejections=r.ejections,
                 engine=r.load.engine if r.load else "unknown",
                 breaker=st.proxy.breakers.states().get(r.cfg.id, "closed"))
        reps.append(s)
    return web.Response(body=orjson.dumps({"policy": st.proxy.policy_name, "replicas": reps}),
                        content_type="application/json")


async def handle_admin_add(request: web.Request) -> web.Response:
    got = await admin_json(request)
    if isinstance(got, web.Response):
        return got
    st, d = got
    try:
        rc = replica_from_dict(d)
        rep = st.pool.add(rc)
    except (ConfigError, ValueError) as exc:
        return _err(400, str(exc).replace("replicas[0].", ""), "invalid_request_error", "invalid_replica")
    await st.pool.check_one(rep)
    replica_added = getattr(st.prefix, "replica_added", None)
    if replica_added is not None:  # its kv_events, if any (docs/kv-events.md)
        await replica_added(rc)
    return web.Response(status=201, body=orjson.dumps({"id": rc.id, "healthy": rep.state.healthy}),
                        content_type="application/json")


async def handle_admin_remove(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if (denied := admin_guard(st, request)) is not None:
        return denied
    rid = request.match_info["id"]
    if not st.pool.remove(rid):
        return _err(404, f"No replica {rid!r}", "invalid_request_error", "replica_not_found")
    return web.Response(body=orjson.dumps({"removed": rid}), content_type="application/json")
