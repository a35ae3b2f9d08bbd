"""The planner's verdict suggests a lower weight precision when it fits on fewer GPUs than
the requested precision needs (not only when it fits on the same GPUs)."""

from __future__ import annotations

from backends.planner import PlanInput, get_gpu, get_model, plan


def test_verdict_offers_a_lower_precision_on_fewer_gpus():
    inp = PlanInput(get_model("llama-3.1-70b"), get_gpu("a100-40gb"), weight_dtype="fp16")
    r = plan(inp)
    assert not r.fits
    assert "needs ≥ 4 GPUs at fp16 or ≥ 2 GPUs at int4" in r.verdict
    # and the suggestions are true: int4 on 2 GPUs fits, int4 on 1 GPU does not
    assert plan(PlanInput(inp.model, inp.gpu, weight_dtype="int4", tensor_parallel=2, num_gpus=2)).fits
    assert not plan(PlanInput(inp.model, inp.gpu, weight_dtype="int4")).fits
    assert plan(PlanInput(inp.model, inp.gpu, weight_dtype="fp16", tensor_parallel=4, num_gpus=4)).fits


def test_verdict_prefers_the_highest_precision_that_fits_on_the_fewest_gpus():
    r = plan(PlanInput(get_model("llama-3.1-70b"), get_gpu("a100-80gb"), weight_dtype="fp16", context=131072))
    assert "needs ≥ 4 GPUs at fp16 or ≥ 2 GPUs at fp8" in r.verdict


def test_verdict_adds_no_precision_when_none_needs_fewer_gpus():
    # the KV cache, not the weights, is short: a smaller weight precision does not save a GPU
    r = plan(PlanInput(get_model("llama-2-13b"), get_gpu("a100-40gb"), weight_dtype="fp16", context=131072))
    assert r.verdict.endswith("needs ≥ 4 GPUs at fp16")
