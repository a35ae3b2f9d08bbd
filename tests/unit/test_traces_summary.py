"""Pure summary helpers of replay: percentiles, Prometheus text parsing, engine counter
deltas and the replay summary built from per-request records."""

from __future__ import annotations

import pytest

from loadtest.summary import (
    distribution,
    engine_hit_delta,
    load_imbalance,
    parse_prometheus,
    percentile,
    summarize_records,
)

METRICS = """# HELP vllm:prefix_cache_queries Prefix cache queries.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{model_name="m",engine="0"} 1000.0
vllm:prefix_cache_hits_total{model_name="m",engine="0"} 250.0
vllm:num_requests_running{model_name="m",engine="0"} 3
vllm:num_requests_running{model_name="m",engine="1"} 2
weird line without value
other_metric NaN
plain_metric 7
"""


def test_percentile_and_distribution():
    assert percentile([], 50) == 0.0
    assert percentile([5], 99) == 5.0
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([3, 1, 2], 100) == 3.0 and percentile([3, 1, 2], 0) == 1.0
    d = distribution(range(1, 101))
    assert d["mean"] == 50.5 and d["max"] == 100 and d["p50"] == pytest.approx(50.5)


def test_load_imbalance():
    assert load_imbalance({"a": 2, "b": 2}) == 1.0
    assert load_imbalance({"a": 3, "b": 1}) == 1.5
    assert load_imbalance({"a": 4}, ["a", "b"]) == 2.0  # an idle replica counts
    assert load_imbalance({}) == 0.0


def test_parse_prometheus_sums_label_sets_and_skips_junk():
    m = parse_prometheus(METRICS)
    assert m["vllm:num_requests_running"] == 5
    assert m["plain_metric"] == 7 and "other_metric" not in m and "weird" not in m


def test_engine_hit_delta():
    before = parse_prometheus(METRICS)
    after = dict(before, **{"vllm:prefix_cache_queries_total": 3000.0, "vllm:prefix_cache_hits_total": 1250.0})
    assert engine_hit_delta(before, after) == {"queries": 2000.0, "hits": 1000.0}
    assert engine_hit_delta({}, {"sglang:cache_hit_rate": 0.5}) is None


def test_summarize_records():
    recs = [
        {"status": 200, "error": None, "replica": "a", "prompt_tokens": 100, "cached_tokens": 50,
         "completion_tokens": 10, "ttft_s": 0.1, "itl_mean_s": 0.01, "e2e_s": 0.2},
        {"status": 200, "error": None, "replica": "b", "prompt_tokens": 300, "cached_tokens": 0,
         "completion_tokens": 10, "ttft_s": 0.3, "itl_mean_s": 0.02, "e2e_s": 0.4},
        {"status": 200, "error": None, "replica": "a", "prompt_tokens": 100, "cached_tokens": 100,
         "completion_tokens": 10, "ttft_s": 0.2, "itl_mean_s": 0.01, "e2e_s": 0.3},
        {"status": 503, "error": "busy", "replica": None, "prompt_tokens": 999, "cached_tokens": 0},
        {"status": None, "error": "timeout", "prompt_tokens": 5},
    ]
    s = summarize_records(recs, wall_s=2.0)
    assert s["requests"] == 5 and s["ok"] == 3
    assert s["errors"] == {"503": 1, "timeout": 1}
    assert s["hit_rate"] == pytest.approx(150 / 500)  # failed requests do not count
    assert s["ttft_p50_s"] == pytest.approx(0.2)
    assert s["throughput_rps"] == 1.5 and s["output_tokens_per_s"] == 15.0
    assert s["per_replica"] == {"a": {"requests": 2, "prompt_tokens": 200, "cached_tokens": 150},
                                "b": {"requests": 1, "prompt_tokens": 300, "cached_tokens": 0}}
    assert s["load_imbalance"] == pytest.approx(2 / 1.5)
