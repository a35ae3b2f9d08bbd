"""Offline replay: engine block hashes from trace ids, the simulation on hand-checkable
traces, and `kvrouter replay --offline` end to end on the Mooncake excerpt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import replay_cli
from loadtest.hitrate import ideal_infinite
from loadtest.offline import OfflineConfig, engine_hashes, simulate
from loadtest.traces.generators import multi_turn
from loadtest.traces.types import TraceRequest

EXCERPT = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head300.jsonl"
SMALL = OfflineConfig(replicas=2, gpu="h100-80gb", model="llama-3.1-8b")


def test_engine_hashes_follow_prefixes_and_partial_blocks():
    a = TraceRequest(0, 1024, 1, [1, 2], block_size=512)
    b = TraceRequest(0, 600, 1, [1, 3], block_size=512)   # second block holds 88 tokens
    c = TraceRequest(0, 1024, 1, [7, 2], block_size=512)  # same id 2 after another prefix
    ha, hb, hc = engine_hashes(a, 16), engine_hashes(b, 16), engine_hashes(c, 16)
    assert len(ha) == 64 and len(hb) == 32 + 88 // 16 and len(set(ha)) == 64
    assert ha[:32] == hb[:32] and ha[32] != hb[32]
    assert not set(hc) & set(ha)
    # a cut-short block is a prefix of the full one
    d = TraceRequest(0, 600, 1, [1, 2], block_size=512)
    assert engine_hashes(d, 16) == ha[: len(engine_hashes(d, 16))]
    assert len(engine_hashes(a, 512)) == 2 and len(engine_hashes(b, 512)) == 1
    with pytest.raises(ValueError, match="multiple"):
        engine_hashes(a, 48)


def test_repeated_prompt_hits_where_the_policy_sends_it():
    # two identical 1,024-token prompts a minute apart on two replicas
    reqs = [TraceRequest(0.0, 1024, 8, [1, 2], 512), TraceRequest(60.0, 1024, 8, [1, 2], 512)]
    ca = simulate(reqs, "cache_aware", SMALL)
    rr = simulate(reqs, "round_robin", SMALL)
    # the engine recomputes the last token, so 63 of 64 blocks hit (1,008 tokens)
    assert ca.cached_tokens == 1008 and ca.prompt_tokens == 2048
    assert ca.hit_rate == pytest.approx(1008 / 2048)
    assert sorted(ca.requests_per_replica.values()) == [0, 2]
    assert rr.cached_tokens == 0 and rr.requests_per_replica == {"r0": 1, "r1": 1}
    assert rr.load_imbalance == 1.0 and ca.load_imbalance == 2.0
    assert all(t > 0 for t in ca.ttfts) and len(ca.ttfts) == 2


def test_simulation_is_deterministic_and_bounded_by_the_ideal():
    reqs = multi_turn(n_sessions=30, turns=(2, 5), rate=2.0, think_time_s=(1, 5), block_size=16, seed=4)
    cfg = OfflineConfig(replicas=4)
    a, b = simulate(reqs, "cache_aware", cfg), simulate(reqs, "cache_aware", cfg)
    assert a.to_dict() == b.to_dict()
    rr = simulate(reqs, "round_robin", cfg)
    assert sum(a.requests_per_replica.values()) == len(reqs) == len(a.ttfts)
    ideal = ideal_infinite(reqs).token_rate
    assert rr.hit_rate < a.hit_rate <= ideal
    assert a.hit_rate > 0.5 * ideal
    assert a.predicted_hit_rate > 0 and sum(a.reasons.values()) == len(reqs)


def test_oversized_prompts_are_skipped_not_fatal():
    reqs = [TraceRequest(0.0, 200_000, 4, [1], 512), TraceRequest(1.0, 100, 4, [2], 512)]
    r = simulate(reqs, "round_robin", SMALL)
    assert r.skipped == 1 and r.prompt_tokens == 100


def test_replay_offline_cli_json_and_plot(tmp_path, capsys):
    png = tmp_path / "p.png"
    rc = replay_cli.main([str(EXCERPT), "--offline", "--limit", "60", "--replicas", "4",
                          "--policies", "round_robin,cache_aware", "--json", "--plot", str(png)])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["requests"] == 60 and set(rep["policies"]) == {"round_robin", "cache_aware"}
    for d in rep["policies"].values():
        assert {"hit_rate", "ttft_p50_s", "ttft_p99_s", "load_imbalance"} <= set(d)
        assert 0 <= d["hit_rate"] <= rep["ideal_infinite_hit_rate"] + 1e-9
    assert rep["ideal_pooled_hit_rate"] <= rep["ideal_infinite_hit_rate"] + 1e-12
    assert rep["policies"]["round_robin"]["load_imbalance"] == 1.0
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("argv, msg", [
    (["--offline", "--policies", "nope"], "unknown policy"),
    (["--offline", "--gpu", "no-such-gpu"], "gpu"),
    (["--offline", "--target", "http://127.0.0.1:1"], "exactly one"),
    ([], "exactly one"),
])
def test_replay_cli_rejects_bad_arguments(argv, msg, capsys):
    assert replay_cli.main([str(EXCERPT), "--limit", "5", *argv]) == 2
    assert msg in capsys.readouterr().err.lower()


def test_coarser_index_blocks_route_the_same_simple_case():
    reqs = [TraceRequest(0.0, 1024, 8, [1, 2], 512), TraceRequest(60.0, 1024, 8, [1, 2], 512),
            TraceRequest(61.0, 1024, 8, [3, 4], 512)]
    fine = simulate(reqs, "cache_aware", SMALL)
    coarse = simulate(reqs, "cache_aware", OfflineConfig(replicas=2, index_block_size=512))
    assert coarse.cached_tokens == fine.cached_tokens == 1008
    assert coarse.predicted_hit_rate == pytest.approx(1023 / 3072)  # 2 index blocks, less the last token
    with pytest.raises(ValueError, match="multiple"):
        simulate(reqs, "cache_aware", OfflineConfig(replicas=2, index_block_size=24))
