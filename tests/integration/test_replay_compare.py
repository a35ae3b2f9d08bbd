"""`loadtest.compare_routers` end to end on a small fleet: sims and routers as real
processes, one row per router, engine-side figures, the offline prediction beside them,
and a note for a router that is not installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import compare_routers

EXCERPT = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head300.jsonl"


def test_compare_routers_prints_one_row_per_router(capsys, monkeypatch):
    monkeypatch.setattr(compare_routers, "external_available", lambda kind: False)
    rc = compare_routers.main([str(EXCERPT), "--limit", "12", "--replicas", "2", "--time-scale", "0",
                               "--speed", "50", "--policies", "round_robin,cache_aware",
                               "--external", "sglang-router", "--with-offline", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["policy"]: r for r in out["rows"]}
    assert set(rows) == {"round_robin", "cache_aware"}
    for r in rows.values():
        assert r["router"] == "kvrouter" and r["ok"] == 12 and not r["errors"]
        assert sum(r["engine_requests"].values()) == 12  # counted by the engines themselves
        assert r["engine_hit_rate"] is not None and 0 <= r["offline_hit_rate"] <= 1
    assert rows["round_robin"]["engine_load_imbalance"] == 1.0
    assert any("sglang-router" in n for n in out["notes"])


@pytest.mark.skipif(not compare_routers.external_available("sglang-router"),
                    reason="sglang-router is not installed (not a project dependency; pip install sglang-router "
                           "to run it)")
def test_compare_routers_runs_sglang_router_when_installed(capsys):
    # sglang-router as a real process on loopback in front of two sims, 8 requests
    rc = compare_routers.main([str(EXCERPT), "--limit", "8", "--replicas", "2", "--time-scale", "0",
                               "--speed", "50", "--policies", "round_robin", "--external", "sglang-router",
                               "--external-policy", "round_robin", "--max-concurrency", "4", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["router"]: r for r in out["rows"]}
    assert set(rows) == {"kvrouter", "sglang-router"}
    sgl = rows["sglang-router"]
    assert sgl["policy"] == "round_robin" and sgl["ok"] == 8 and not sgl["errors"]
    assert sum(sgl["engine_requests"].values()) == 8  # the engines saw every request
    assert not any("sglang-router" in n for n in out["notes"])
