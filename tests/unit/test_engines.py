"""The engine metric reader: vLLM and SGLang load figures from /metrics text."""

from __future__ import annotations

import pytest

from backends.engines import parse_load, parse_samples

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.3
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",num_gpu_blocks="5012"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="m"} 4.0
vllm:num_requests_running_extra 99
"""

SGLANG = """sglang:num_running_reqs{model_name="m",tp_rank="0"} 4
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 1
sglang:token_usage{model_name="m",tp_rank="0"} 0.75
sglang:max_total_num_tokens{model_name="m"} 120000
"""


def test_vllm():
    load = parse_load(VLLM)
    assert load.engine == "vllm"
    assert (load.running, load.waiting) == (5.0, 7.0)
    assert load.kv_usage == pytest.approx(0.4)
    assert (load.num_blocks, load.block_size) == (5012, 16)


def test_sglang():
    load = parse_load(SGLANG)
    assert load.engine == "sglang"
    assert (load.running, load.waiting, load.kv_usage, load.max_total_tokens) == (4, 1, 0.75, 120000)


def test_legacy_vllm_kv_name_and_no_labels():
    load = parse_load("vllm:gpu_cache_usage_perc 0.9\nvllm:num_requests_running 1\n")
    assert load.kv_usage == pytest.approx(0.9) and load.running == 1


@pytest.mark.parametrize("text", ["", "garbage\n{{{ }", "vllm:num_requests_running{a=\"1\"} NaN\n",
                                  "vllm:num_requests_running{a=\"1\"} notanumber\n",
                                  "vllm:num_requests_running{broken 3\n"])
def test_bad_input_never_raises(text):
    load = parse_load(text)
    assert load.running == 0.0 and load.engine in ("unknown", "vllm")


def test_labels_with_escapes_and_timestamps():
    s = parse_samples('vllm:num_requests_running{model_name="a\\"b,c",engine="0"} 2 1700000000000\n')
    assert s == [("vllm:num_requests_running", {"model_name": 'a"b,c', "engine": "0"}, 2.0)]


def test_kv_usage_clamped():
    assert parse_load("vllm:kv_cache_usage_perc 1.7\n").kv_usage == 1.0
