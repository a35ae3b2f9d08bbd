"""Kubernetes EndpointSlice discovery against a stand-in API server (aiohttp on 127.0.0.1),
plus the pure helpers of router/discovery.py and router/lifecycle.py.

The stand-in checks what the real API server would: the path, the label selector and the
service-account bearer token (re-read from the token file on every call, as projected
tokens rotate). Only ready endpoints become replicas.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from router.config import Config, DiscoveryConfig
from router.discovery import KubernetesResolver, merge, parse_endpoint_slices, replicas_for
from router.lifecycle import plan_reload
from tests.support.services import free_port


def slice_doc(ready: list[str], not_ready: list[str], port: int = 8000, name: str = "http") -> dict[str, Any]:
    eps = [{"addresses": [a], "conditions": {"ready": True}} for a in ready]
    eps += [{"addresses": [a], "conditions": {"ready": False, "terminating": True}} for a in not_ready]
    return {"kind": "EndpointSliceList", "items": [
        {"addressType": "IPv4", "ports": [{"name": name, "port": port, "protocol": "TCP"},
                                          {"name": "kv-events", "port": 5557}], "endpoints": eps}]}


def test_parse_endpoint_slices_keeps_ready_endpoints_and_picks_the_port():
    doc = slice_doc(["10.0.0.2", "10.0.0.1"], ["10.0.0.3"])
    doc["items"].append({"ports": [{"name": "http", "port": 8000}],
                         "endpoints": [{"addresses": ["10.0.1.1"]}]})  # no conditions: ready
    assert parse_endpoint_slices(doc) == [("10.0.0.1", 8000), ("10.0.0.2", 8000), ("10.0.1.1", 8000)]
    assert parse_endpoint_slices(doc, "kv-events") == [("10.0.0.1", 5557), ("10.0.0.2", 5557)]
    assert parse_endpoint_slices(doc, "nope") == []
    assert parse_endpoint_slices({"items": None}) == []


def test_replicas_for_ids_are_stable_and_ipv6_is_bracketed():
    dc = DiscoveryConfig(mode="dns", name="x", port=8000, models=("m",), api_key="k")
    reps = replicas_for([("10.0.0.2", 8000), ("fd00::1", 8000), ("10.0.0.2", 8000)], dc)
    assert [(r.id, r.url) for r in reps] == [("10.0.0.2:8000", "http://10.0.0.2:8000"),
                                              ("[fd00::1]:8000", "http://[fd00::1]:8000")]
    assert all(r.models == ("m",) and r.api_key == "k" for r in reps)
    # every reps url is one the config loader accepts
    Config.from_dict({"replicas": [{"id": r.id, "url": r.url, "models": ["m"]} for r in reps]})
    static = Config.from_dict({"replicas": [{"id": "a", "url": "http://10.0.0.2:8000", "models": ["m"]}]}).replicas
    assert [r.id for r in merge(static, reps)] == ["a", "[fd00::1]:8000"]  # same URL: the static one wins


def test_plan_reload_names_what_changes_and_what_needs_a_restart():
    base = {"replicas": [{"url": "http://h:1", "models": ["m"]}], "policy": {"name": "cache_aware"}}
    old = Config.from_dict(base)
    assert not plan_reload(old, Config.from_dict(base)).changed
    new = Config.from_dict({**base, "policy": {"name": "cache_aware", "options": {"hit_weight": 0.0}},
                            "listen": {"port": 9999}, "auth": {"api_keys": ["k"]}})
    p = plan_reload(old, new)
    assert p.policy and p.auth and not p.membership and p.restart_only == ("listen",)
    p2 = plan_reload(old, Config.from_dict({**base, "discovery": {"mode": "dns", "name": "e", "models": ["m"]}}))
    assert p2.membership and not p2.policy and p2.describe() == "membership"


async def test_kubernetes_resolver_reads_endpointslices_with_the_service_account(tmp_path: Path):
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("token-1")
    (sa / "namespace").write_text("inference")
    seen: list[tuple[str, str, str]] = []
    state = {"doc": slice_doc(["10.1.0.1", "10.1.0.2"], ["10.1.0.9"])}

    async def endpointslices(request: web.Request) -> web.Response:
        seen.append((request.path, request.query.get("labelSelector", ""), request.headers.get("Authorization", "")))
        if request.headers.get("Authorization") not in ("Bearer token-1", "Bearer token-2"):
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        return web.json_response(state["doc"])

    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", endpointslices)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        res = KubernetesResolver(None, "http", sa_dir=sa, api_url=f"http://127.0.0.1:{port}")
        assert res.namespace == "inference"
        assert await res("vllm", 8000) == [("10.1.0.1", 8000), ("10.1.0.2", 8000)]
        assert seen[-1] == ("/apis/discovery.k8s.io/v1/namespaces/inference/endpointslices",
                            "kubernetes.io/service-name=vllm", "Bearer token-1")
        (sa / "token").write_text("token-2")  # rotated
        state["doc"] = slice_doc(["10.1.0.2"], ["10.1.0.1"])
        assert await res("vllm", 8000) == [("10.1.0.2", 8000)]
        assert seen[-1][2] == "Bearer token-2"
        (sa / "token").write_text("revoked")
        with pytest.raises(RuntimeError, match="HTTP 401"):
            await res("vllm", 8000)
    finally:
        await runner.cleanup()
