"""The capacity planner's formulas: the articles' worked examples pinned exactly, then the
behaviour of precisions, tensor parallelism, MoE, config.json parsing and the verdict."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.planner import (
    DRAFT_STEP_COST_RATIO,
    GPU_PRESETS,
    INT4_GROUP_SIZE,
    MAX_NUM_SEQS,
    MODEL_PRESETS,
    PlanInput,
    PlannerError,
    Roofline,
    get_gpu,
    get_model,
    kv_cache_bytes,
    plan,
)

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10
LLAMA8 = get_model("llama-3.1-8b")
A100_40 = get_gpu("a100-40gb")

# Llama 3.1 8B's config.json as published on the Hugging Face hub (the fields the planner reads).
LLAMA_3_1_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
MIXTRAL_CONFIG = {
    "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
    "num_experts_per_tok": 2, "max_position_embeddings": 32768,
}


def inp(**kw) -> PlanInput:
    base = {"model": LLAMA8, "gpu": A100_40}
    base.update(kw)
    return PlanInput(**base)


# ---- the articles' worked examples ---------------------------------------------------------

def test_llama_8b_weights_fp16_is_16_gb_and_fp32_is_32_gb():
    assert plan(inp(weight_dtype="fp16")).weights_bytes == 16_000_000_000  # 8e9 × 2 B
    assert plan(inp(weight_dtype="bf16")).weights_bytes == 16_000_000_000
    assert plan(inp(weight_dtype="fp32")).weights_bytes == 32_000_000_000  # 8e9 × 4 B


def test_naive_kv_is_half_a_mib_per_token_and_64_gib_at_128k():
    r = plan(inp(weight_dtype="fp16", context=131072))
    assert r.kv_bytes_per_token_naive == 2 * 32 * 4096 * 2 == 512 * KiB
    assert r.kv_bytes_per_sequence_naive == 64 * GiB
    # the article's "68.7 GB" is the same bytes in decimal units
    assert round(r.kv_bytes_per_sequence_naive / 1e9, 1) == 68.7


def test_gqa_kv_is_128_kib_per_token_and_16_gib_per_128k_sequence():
    r = plan(inp(weight_dtype="fp16", context=131072))
    assert r.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 128 * KiB
    assert r.kv_bytes_per_sequence == 16 * GiB
    assert r.kv_bytes_per_token_naive == 4 * r.kv_bytes_per_token  # 32 query heads share 8 KV heads


def test_int8_kv_example_is_512_mib():
    assert kv_cache_bytes(batch=1, seq_len=2048, layers=32, width=4096, bytes_per_elem=1) == 512 * MiB
    # the same figure from the model: one byte per element (fp8 KV), naive width, 2,048 tokens
    r = plan(inp(kv_dtype="fp8", context=2048))
    assert r.kv_bytes_per_sequence_naive == 512 * MiB


def test_8b_at_128k_on_a100_40gb_fits_one_sequence_with_gqa_but_not_naively():
    r = plan(inp(weight_dtype="fp16", context=131072))
    assert r.fits and r.max_concurrent_sequences == 1
    assert r.kv_bytes_per_sequence_naive > r.kv_bytes_available_per_gpu  # the article's OOM
    assert r.kv_capacity_tokens >= 131072 > r.kv_bytes_available_per_gpu // r.kv_bytes_per_token_naive


# ---- precisions ------------------------------------------------------------------------------

def test_fp8_kv_doubles_capacity():
    auto, fp8 = plan(inp()), plan(inp(kv_dtype="fp8"))
    assert fp8.kv_bytes_per_token * 2 == auto.kv_bytes_per_token
    assert fp8.kv_bytes_available_per_gpu == auto.kv_bytes_available_per_gpu
    assert fp8.kv_capacity_blocks in (2 * auto.kv_capacity_blocks, 2 * auto.kv_capacity_blocks + 1)
    assert Roofline(inp(kv_dtype="fp8")).kv_capacity_blocks == fp8.kv_capacity_blocks


def test_int4_shrinks_weights_with_group_scale_overhead():
    embed = 2 * 128256 * 4096  # embeddings + LM head stay 16 bit
    linear = 8.0e9 - embed
    per_weight = 0.5 + (2 + 0.5) / INT4_GROUP_SIZE  # 4 bits + fp16 scale and 4-bit zero per group
    r = plan(inp(weight_dtype="int4"))
    assert r.weights_bytes == round(linear * per_weight + embed * 2)
    assert r.weights_bytes > linear * 0.5 + embed * 2  # the group overhead is counted
    assert r.weights_bytes < plan(inp(weight_dtype="int8")).weights_bytes < plan(inp()).weights_bytes
    assert plan(inp(weight_dtype="int4")).kv_capacity_blocks > plan(inp()).kv_capacity_blocks


def test_quantized_compute_uses_the_matching_peak():
    h100 = get_gpu("h100-80gb")
    assert Roofline(inp(gpu=h100, weight_dtype="fp8")).peak_flops == h100.flops["fp8"]
    assert Roofline(inp(gpu=h100, weight_dtype="int4")).peak_flops == h100.flops["bf16"]  # weight-only
    fp8, bf16 = plan(inp(gpu=h100, weight_dtype="fp8")), plan(inp(gpu=h100))
    assert fp8.prefill_tokens_per_s == pytest.approx(2 * bf16.prefill_tokens_per_s, rel=0.01)
    assert fp8.decode_tokens_per_s_per_seq > bf16.decode_tokens_per_s_per_seq  # fewer bytes per step


# ---- tensor parallelism, replicas, MoE -------------------------------------------------------

def test_tensor_parallel_divides_weights_per_gpu():
    one, two = plan(inp(weight_dtype="fp16")), plan(inp(weight_dtype="fp16", tensor_parallel=2, num_gpus=2))
    assert two.weights_bytes == one.weights_bytes
    assert two.weights_bytes_per_gpu == one.weights_bytes_per_gpu // 2
    assert two.kv_capacity_blocks > 2 * one.kv_capacity_blocks  # half the weights per GPU, twice the GPUs
    assert two.decode_tokens_per_s_per_seq > one.decode_tokens_per_s_per_seq


def test_replicas_multiply_fleet_figures_only():
    one, four = plan(inp()), plan(inp(num_gpus=4))
    assert four.replicas == 4 and four.kv_capacity_blocks == one.kv_capacity_blocks
    assert four.decode_tokens_per_s_total == pytest.approx(4 * one.decode_tokens_per_s_total)
    assert four.max_concurrent_users == 4 * one.max_concurrent_users


def test_moe_holds_total_params_but_computes_with_active():
    mixtral = get_model("mixtral-8x7b")
    assert mixtral.active_params < mixtral.total_params
    rl = Roofline(PlanInput(mixtral, get_gpu("h200")))
    assert rl.weights_bytes == round(46.7e9 * 2)
    assert rl.flops_per_token == 2 * 12.9e9
    # one token reads ~the active experts; a large batch reads nearly all of them
    assert rl.weights_bytes_read(1) == pytest.approx(12.9e9 * 2, rel=0.02)
    assert rl.weights_bytes_read(512) == pytest.approx(rl.weights_bytes, rel=0.01)
    dense = Roofline(PlanInput(get_model("llama-3.1-70b"), get_gpu("h200"), weight_dtype="fp8"))
    assert rl.decode_step_time_s(1, 1000) < dense.decode_step_time_s(1, 1000)


def test_mixtral_on_one_h100_needs_more_gpus_or_a_smaller_dtype():
    r = plan(PlanInput(get_model("mixtral-8x7b"), get_gpu("h100-80gb")))
    assert not r.fits
    assert "needs ≥ 2 GPUs at bf16 or fp8" in r.verdict


# ---- config.json -----------------------------------------------------------------------------

def test_config_json_path_counts_parameters(tmp_path):
    path = tmp_path / "Llama-3.1-8B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA_3_1_8B_CONFIG))
    for arg in (str(path), str(path.parent)):
        m = get_model(arg)
        assert m.name == "Llama-3.1-8B"
        assert m.total_params == m.active_params == 8_030_261_248  # the published count
        assert (m.num_kv_heads, m.head_dim, m.num_layers) == (8, 128, 32)
        r = plan(inp(model=m, weight_dtype="fp16", context=131072))
        assert r.kv_bytes_per_token == 128 * KiB and r.weights_bytes == 2 * 8_030_261_248


def test_config_json_moe_counts_total_and_active(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL_CONFIG))
    m = get_model(str(path))
    assert (m.num_experts, m.experts_per_token) == (8, 2)
    assert round(m.total_params / 1e9, 1) == 46.7 and round(m.active_params / 1e9, 1) == 12.9


def test_bad_config_json_is_a_clear_error(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(PlannerError, match="cannot read model config"):
        get_model(str(bad))
    bad.write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(PlannerError, match="num_hidden_layers"):
        get_model(str(bad))


# ---- fit, verdict, errors --------------------------------------------------------------------

def test_70b_on_one_gpu_does_not_fit_and_the_verdict_says_what_would():
    r = plan(PlanInput(get_model("llama-3.1-70b"), get_gpu("a100-80gb"), weight_dtype="fp16"))
    assert not r.fits and r.kv_capacity_blocks == 0
    assert r.verdict.startswith("does not fit")
    assert "needs ≥ 2 GPUs at fp16 or int4" in r.verdict
    assert plan(PlanInput(get_model("llama-3.1-70b"), get_gpu("a100-80gb"), weight_dtype="fp16",
                          tensor_parallel=2, num_gpus=2)).fits
    assert plan(PlanInput(get_model("llama-3.1-70b"), get_gpu("a100-80gb"), weight_dtype="int4")).fits


def test_kv_bound_misfit_suggests_fp8_kv():
    r = plan(inp(weight_dtype="fp16", context=131072, batch_size=2))
    assert not r.fits and "KV cache holds" in r.verdict and "--kv-dtype fp8" in r.verdict
    assert plan(inp(weight_dtype="fp16", context=131072, batch_size=2, kv_dtype="fp8")).fits


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("weight_dtype", "int3", "fp32, fp16, bf16, fp8, int8, int4"), ("kv_dtype", "int8", "auto"),
     ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"), ("tensor_parallel", 3, "attention heads"),
     ("num_gpus", 3, "multiple of tensor_parallel"), ("context", 0, "context"),
     ("prompt_tokens", 0, "prompt_tokens"), ("spec_tokens", -1, "spec_tokens"),
     ("spec_acceptance", 1.2, "spec_acceptance")],
)
def test_bad_inputs_raise_planner_error(field, value, match):
    kw = {field: value}
    if field == "num_gpus":
        kw["tensor_parallel"] = 2
    with pytest.raises(PlannerError, match=match):
        plan(inp(**kw))


def test_unknown_model_and_gpu_name_the_known_values():
    with pytest.raises(PlannerError, match="llama-3.1-8b.*mixtral-8x7b"):
        get_model("gpt-5")
    with pytest.raises(PlannerError, match="a100-40gb, a100-80gb, h100-80gb, h200, l4"):
        get_gpu("tpu-v5")


def test_required_presets_exist():
    for name in ("llama-3.1-8b", "llama-3.1-70b", "llama-2-13b", "qwen2.5-7b", "mixtral-8x7b"):
        assert name in MODEL_PRESETS
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h200", "l4"):
        gpu = GPU_PRESETS[name]
        assert gpu.memory_bytes > 0 and gpu.bandwidth_bytes_per_s > 0
        assert {"bf16", "fp8", "int8"} <= set(gpu.flops)


# ---- the roofline the simulator uses ---------------------------------------------------------

def test_step_costs_follow_the_roofline():
    rl = Roofline(inp())
    assert rl.step_time_s(0, 0, 0) == 0.0
    # decode is memory-bound: more KV read costs more, a few more sequences barely cost more
    assert rl.decode_step_time_s(8, 80_000) > rl.decode_step_time_s(8, 8_000)
    assert rl.decode_step_time_s(8, 8_000) < 1.1 * rl.decode_step_time_s(1, 1_000)
    # prefill is compute-bound: 2,000 uncached tokens cost far more than a 16-token tail
    assert rl.prefill_time_s(2000) > 5 * rl.prefill_time_s(16)
    assert rl.prefill_time_s(4000) == pytest.approx(2 * rl.prefill_time_s(2000), rel=0.02)
    mixed = rl.step_time_s(512, 32, 32_000)
    assert mixed >= max(rl.prefill_time_s(512), rl.decode_step_time_s(32, 32_000)) - 1e-12


def test_speculative_decoding_tokens_per_step_and_cost():
    plain = Roofline(inp())
    rl = Roofline(inp(spec_tokens=4, spec_acceptance=0.8))
    assert rl.spec_tokens_per_step() == pytest.approx((1 - 0.8**5) / (1 - 0.8)) == pytest.approx(3.3616)
    assert plain.spec_tokens_per_step() == 1.0
    assert plain.spec_step_time_s(4, 4000) == plain.decode_step_time_s(4, 4000)
    assert Roofline(inp(spec_tokens=3, spec_acceptance=1.0)).spec_tokens_per_step() == 4.0
    target = rl.decode_step_time_s(1, 1000)
    assert rl.spec_step_time_s(1, 1000) >= target * (1 + 4 * DRAFT_STEP_COST_RATIO)
    speedup = rl.decode_tokens_per_s_per_seq(1, 1000) / plain.decode_tokens_per_s_per_seq(1, 1000)
    assert 1.5 < speedup < 3.3616


def test_speed_and_concurrency_outputs_are_consistent():
    r = plan(inp(batch_size=8, prompt_tokens=2000, output_tokens=200))
    assert r.decode_tokens_per_s_total == pytest.approx(8 * r.decode_tokens_per_s_per_seq)
    assert r.ttft_s == pytest.approx(Roofline(inp()).prefill_time_s(2000))
    assert r.request_latency_s == pytest.approx(r.ttft_s + 199 / r.decode_tokens_per_s_per_seq)
    assert r.max_concurrent_users == min(r.kv_capacity_tokens // 2200, MAX_NUM_SEQS)
    small = plan(inp(model=get_model("llama-3.2-1b"), gpu=get_gpu("h200"), prompt_tokens=100, output_tokens=10))
    assert small.max_concurrent_users == MAX_NUM_SEQS
    assert r.kv_capacity_tokens == r.kv_capacity_blocks * 16
    assert math.isfinite(r.max_requests_per_s) and r.max_requests_per_s > 0


def test_to_dict_has_every_key_of_the_issue_and_is_json():
    d = plan(inp(weight_dtype="fp16", context=131072)).to_dict()
    keys = [
        "weights_bytes", "kv_bytes_per_token", "kv_bytes_per_token_naive", "kv_bytes_per_sequence",
        "overhead_bytes", "kv_capacity_tokens", "kv_capacity_blocks", "max_concurrent_sequences",
        "prefill_tokens_per_s", "decode_tokens_per_s_per_seq", "decode_tokens_per_s_total", "ttft_s",
        "request_latency_s", "max_concurrent_users", "fits", "verdict", "model", "gpu", "num_gpus",
        "tensor_parallel", "weight_dtype", "kv_dtype", "gpu_memory_utilization", "context", "batch_size",
        "prompt_tokens", "output_tokens", "block_size",
    ]
    assert set(keys) <= set(d)
    assert json.loads(json.dumps(d)) == d


@settings(max_examples=150, deadline=None)
@given(
    model=st.sampled_from(sorted(MODEL_PRESETS)), gpu=st.sampled_from(sorted(GPU_PRESETS)),
    dtype=st.sampled_from(["fp32", "fp16", "bf16", "fp8", "int8", "int4"]), tp=st.sampled_from([1, 2, 4, 8]),
    replicas=st.integers(1, 4), context=st.integers(1, 300_000), batch=st.integers(1, 512),
    prompt=st.integers(1, 50_000), output=st.integers(1, 8_000), block=st.sampled_from([1, 16, 32, 128]),
    k=st.integers(0, 8), a=st.floats(0, 1),
)
def test_plan_is_total_and_consistent(model, gpu, dtype, tp, replicas, context, batch, prompt, output, block, k, a):
    m = get_model(model)
    if m.num_attention_heads % tp:
        return
    base = PlanInput(m, get_gpu(gpu), num_gpus=tp * replicas, tensor_parallel=tp, weight_dtype=dtype,
                     context=context, batch_size=batch, prompt_tokens=prompt, output_tokens=output,
                     block_size=block, spec_tokens=k, spec_acceptance=a)
    r = plan(base)
    d = r.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert r.kv_capacity_tokens == r.kv_capacity_blocks * block >= 0
    assert r.fits == (r.kv_capacity_tokens >= batch * context) == r.verdict.startswith("fits")
    for value in (r.decode_tokens_per_s_per_seq, r.request_latency_s, r.prefill_tokens_per_s):
        assert math.isfinite(value) and value > 0
    assert r.request_latency_s >= r.ttft_s >= 0
    fp8 = plan(replace(base, kv_dtype="fp8"))
    assert fp8.kv_capacity_blocks >= 2 * r.kv_capacity_blocks
