"""The capacity planner: GPU memory, KV cache, throughput and concurrency of one deployment.

Pure formulas (no I/O besides :func:`get_model` reading a ``config.json`` path). Two entry
points: :func:`plan` answers a user's sizing question (``kvrouter plan``), and
:class:`Roofline` is the cost model the simulated engine takes its KV capacity and step
durations from. Every assumption is a named constant below; ``docs/planner.md`` explains them.

Memory per GPU (vLLM's accounting): ``gpu_memory_utilization × memory`` is the budget; the
weights (÷ tensor-parallel size) and the overhead come off it; the rest is KV cache.
Speed: a step costs the larger of its compute time (2 × active params FLOPs per token) and
its memory time (weights + KV bytes read), plus a fixed per-step overhead.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from backends.presets import (
    GPU_PRESETS,
    MODEL_PRESETS,
    GiB,
    GPUSpec,
    ModelSpec,
    PlannerError,
    get_gpu,
    get_model,
    model_from_config,
)

__all__ = [
    "GPU_PRESETS", "MODEL_PRESETS", "GPUSpec", "ModelSpec", "PlanInput", "PlanResult", "PlannerError",
    "Roofline", "get_gpu", "get_model", "kv_cache_bytes", "model_from_config", "plan",
]

# ---- precisions -------------------------------------------------------------------------
# Bytes per weight. int4 = AWQ/GPTQ: 4-bit weights plus, per group of INT4_GROUP_SIZE weights,
# one fp16 scale and one 4-bit zero point. fp8/int8 per-channel scales are one value per
# output row (< 0.1 %) and are ignored.
INT4_GROUP_SIZE = 128
INT4_SCALE_BYTES = 2.0  # fp16 scale per group
INT4_ZERO_BYTES = 0.5  # 4-bit zero point per group (AWQ / GPTQ asymmetric)
WEIGHT_BYTES: dict[str, float] = {
    "fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0,
    "int4": 0.5 + (INT4_SCALE_BYTES + INT4_ZERO_BYTES) / INT4_GROUP_SIZE,
}
QUANTIZED = frozenset({"fp8", "int8", "int4"})
# Quantized checkpoints keep the embeddings and LM head in 16 bit (vLLM quantizes the
# linear layers of the transformer blocks only).
EMBEDDING_BYTES_WHEN_QUANTIZED = 2.0
# Which peak FLOP/s a weight precision computes at: int4 (weight-only AWQ/GPTQ) dequantizes
# to 16 bit; int8 is W8A8; fp8 is W8A8 where the GPU has FP8 tensor cores.
COMPUTE_KEY: dict[str, str] = {
    "fp32": "fp32", "fp16": "bf16", "bf16": "bf16", "fp8": "fp8", "int8": "int8", "int4": "bf16",
}
# KV cache element size. "auto" follows the model's activation dtype, as vLLM does:
# 2 bytes, or 4 for an fp32 model.
KV_BYTES: dict[str, int] = {"fp16": 2, "bf16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
KV_DTYPES = ("auto", *KV_BYTES)

# ---- memory assumptions -----------------------------------------------------------------
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
# Non-torch memory inside the budget: CUDA context, cuBLAS/NCCL workspaces (vLLM measures
# ~0.5-1.5 GiB per GPU; one GiB assumed).
NON_TORCH_BYTES = 1 * GiB
# vLLM's activation peak comes from a profiling run over max_num_batched_tokens tokens.
PROFILE_TOKENS = 8192  # vLLM's default max_num_batched_tokens for online serving on A100/H100
MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs: the largest decode batch per replica
ACTIVATION_BYTES = 2  # bytes per activation element (4 for fp32 models)
LOGIT_BYTES = 4  # the sampler holds fp32 logits for MAX_NUM_SEQS rows of the vocabulary

# ---- speed assumptions ------------------------------------------------------------------
PREFILL_EFFICIENCY = 0.5  # achieved / peak FLOP/s (model FLOPs utilization; articles: 0.3-0.6)
BANDWIDTH_EFFICIENCY = 0.8  # achieved / peak HBM bandwidth in memory-bound decode
STEP_OVERHEAD_S = 0.001  # per engine step: scheduling, sampling, launch (CUDA graphs on)
TP_ALLREDUCE_S = 10e-6  # latency of one tensor-parallel all-reduce; two per layer per step
# Speculative decoding: each of the k draft steps costs this fraction of a target decode
# step at the same batch (a draft model ~1/10 of the target, or an EAGLE head).
DRAFT_STEP_COST_RATIO = 0.1
MAX_SEARCH_GPUS = 64  # the verdict looks for a tensor-parallel size up to this many GPUs


def kv_cache_bytes(batch: int, seq_len: int, layers: int, width: int, bytes_per_elem: float) -> float:
    """The articles' KV formula: 2 (K and V) × batch × sequence × layers × width × bytes."""
    return 2 * batch * seq_len * layers * width * bytes_per_elem


@dataclass(frozen=True)
class PlanInput:
    model: ModelSpec
    gpu: GPUSpec
    num_gpus: int = 1
    tensor_parallel: int = 1
    weight_dtype: str = "bf16"  # fp32 fp16 bf16 fp8 int8 int4 (int4 = AWQ/GPTQ, group-128 scales)
    kv_dtype: str = "auto"  # auto (= activation dtype) or fp8 (1 byte)
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    context: int = 8192
    batch_size: int = 1
    prompt_tokens: int = 1024
    output_tokens: int = 256
    block_size: int = 16
    spec_tokens: int = 0  # speculative decoding: k draft tokens per step
    spec_acceptance: float = 0.0  # a: per-token acceptance probability


def validate(inp: PlanInput) -> None:
    """Raise :class:`PlannerError` naming the first bad field of ``inp``."""
    if inp.weight_dtype not in WEIGHT_BYTES:
        raise PlannerError(f"unknown weight dtype {inp.weight_dtype!r}; known: {', '.join(WEIGHT_BYTES)}")
    if inp.kv_dtype not in KV_DTYPES:
        raise PlannerError(f"unknown KV dtype {inp.kv_dtype!r}; known: {', '.join(KV_DTYPES)}")
    if not 0 < inp.gpu_memory_utilization <= 1:
        raise PlannerError("gpu_memory_utilization must be in (0, 1]")
    for field in ("num_gpus", "tensor_parallel", "context", "batch_size", "prompt_tokens", "output_tokens",
                  "block_size"):
        if int(getattr(inp, field)) < 1:
            raise PlannerError(f"{field} must be >= 1")
    if inp.spec_tokens < 0:
        raise PlannerError("spec_tokens must be >= 0")
    if not 0 <= inp.spec_acceptance <= 1:
        raise PlannerError("spec_acceptance must be in [0, 1]")
    if inp.model.num_attention_heads % inp.tensor_parallel:
        raise PlannerError(
            f"tensor_parallel ({inp.tensor_parallel}) must divide the model's "
            f"{inp.model.num_attention_heads} attention heads"
        )
    if inp.num_gpus % inp.tensor_parallel:
        raise PlannerError(f"num_gpus ({inp.num_gpus}) must be a multiple of tensor_parallel ({inp.tensor_parallel})")


class Roofline:
    """The cost model: what one engine step costs on this model/GPU/precision (one replica =
    one tensor-parallel group of ``inp.tensor_parallel`` GPUs)."""

    def __init__(self, inp: PlanInput) -> None:
        validate(inp)
        self.inp = inp
        m, tp = inp.model, inp.tensor_parallel
        fp32 = inp.weight_dtype == "fp32"
        self.activation_bytes = 4 if fp32 else ACTIVATION_BYTES
        self.kv_elem_bytes = (4 if fp32 else 2) if inp.kv_dtype == "auto" else KV_BYTES[inp.kv_dtype]
        # weights
        wb = WEIGHT_BYTES[inp.weight_dtype]
        emb_b = EMBEDDING_BYTES_WHEN_QUANTIZED if inp.weight_dtype in QUANTIZED else wb
        linear = max(m.total_params - m.embedding_params, 0.0)
        self.weights_bytes = int(round(linear * wb + m.embedding_params * emb_b))
        self.weights_bytes_per_gpu = self.weights_bytes / tp
        self._linear_byte = wb
        # MoE split: X params per expert, the rest of the linear params always read
        self._expert_params = (
            (m.total_params - m.active_params) / (m.num_experts - m.experts_per_token)
            if m.num_experts > m.experts_per_token else 0.0
        )
        self._always_linear = linear - m.num_experts * self._expert_params if self._expert_params else linear
        # per step the LM head is read whole; the input embedding only row by row
        self._lm_head_bytes = m.vocab_size * m.hidden_size * emb_b
        # KV: 2 (K, V) × layers × kv heads × head_dim × bytes; heads split over TP (replicated
        # when TP exceeds the KV head count, as vLLM does)
        self.kv_bytes_per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * self.kv_elem_bytes
        self.kv_bytes_per_token_naive = 2 * m.num_layers * m.hidden_size * self.kv_elem_bytes
        self.kv_bytes_per_token_per_gpu = (
            2 * m.num_layers * math.ceil(m.num_kv_heads / tp) * m.head_dim * self.kv_elem_bytes
        )
        # overhead and KV capacity per GPU
        # activation peak: per profiled token, the gated MLP's gate+up output (2 × intermediate
        # per routed expert, split over TP) plus four hidden-size buffers (residual, normed
        # input, attention output, MLP output)
        act = PROFILE_TOKENS * (2 * m.intermediate_size * m.experts_per_token / tp + 4 * m.hidden_size)
        self.overhead_bytes = int(NON_TORCH_BYTES + act * self.activation_bytes
                                  + MAX_NUM_SEQS * m.vocab_size * LOGIT_BYTES / tp)
        self.budget_bytes_per_gpu = int(inp.gpu_memory_utilization * inp.gpu.memory_bytes)
        self.kv_bytes_available_per_gpu = int(
            self.budget_bytes_per_gpu - self.weights_bytes_per_gpu - self.overhead_bytes
        )
        self.weights_fit = self.kv_bytes_available_per_gpu > 0
        self.kv_capacity_blocks = max(
            0, self.kv_bytes_available_per_gpu // (self.kv_bytes_per_token_per_gpu * inp.block_size)
        )
        self.kv_capacity_tokens = self.kv_capacity_blocks * inp.block_size
        # speed
        self.peak_flops = inp.gpu.flops.get(COMPUTE_KEY[inp.weight_dtype], inp.gpu.flops["bf16"])
        self.flops_per_token = 2.0 * m.active_params

    def weights_bytes_read(self, tokens: int) -> float:
        """Weight bytes one step over ``tokens`` tokens reads (all GPUs of the replica).
        MoE: the experts touched by ``tokens`` tokens routed uniformly at random."""
        m = self.inp.model
        experts = 0.0
        if self._expert_params:
            share = 1.0 - (1.0 - m.experts_per_token / m.num_experts) ** max(tokens, 1)
            experts = m.num_experts * share * self._expert_params
        return (self._always_linear + experts) * self._linear_byte + self._lm_head_bytes

    def step_time_s(self, prefill_tokens: int, decode_seqs: int, kv_tokens_read: int) -> float:
        """One continuous-batching step: max(compute, memory) + fixed per-step overhead."""
        tokens = prefill_tokens + decode_seqs
        if tokens <= 0:
            return 0.0
        tp = self.inp.tensor_parallel
        compute = tokens * self.flops_per_token / (self.peak_flops * tp * PREFILL_EFFICIENCY)
        memory_bytes = (self.weights_bytes_read(tokens) / tp
                        + kv_tokens_read * self.kv_bytes_per_token_per_gpu)
        memory = memory_bytes / (self.inp.gpu.bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY)
        comm = 2 * self.inp.model.num_layers * TP_ALLREDUCE_S if tp > 1 else 0.0
        return max(compute, memory) + STEP_OVERHEAD_S + comm

    def prefill_time_s(self, tokens: int) -> float:
        return self.step_time_s(tokens, 0, 0)

    def decode_step_time_s(self, batch: int, kv_tokens: int) -> float:
        return self.step_time_s(0, batch, kv_tokens)

    def spec_tokens_per_step(self) -> float:
        """Expected tokens per target step: (1 − a^(k+1)) / (1 − a); 1.0 when k == 0."""
        k, a = self.inp.spec_tokens, self.inp.spec_acceptance
        if k == 0:
            return 1.0
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def spec_step_time_s(self, decode_seqs: int, kv_tokens: int) -> float:
        """A target step verifying k+1 tokens per sequence, plus k draft steps each costing
        DRAFT_STEP_COST_RATIO of a plain decode step. Equals the decode step when k == 0."""
        k = self.inp.spec_tokens
        if k == 0:
            return self.decode_step_time_s(decode_seqs, kv_tokens)
        verify = self.step_time_s(decode_seqs * k, decode_seqs, kv_tokens)
        return verify + k * DRAFT_STEP_COST_RATIO * self.decode_step_time_s(decode_seqs, kv_tokens)

    def decode_tokens_per_s_per_seq(self, batch: int, kv_tokens: int) -> float:
        return self.spec_tokens_per_step() / self.spec_step_time_s(batch, kv_tokens)


@dataclass(frozen=True)
class PlanResult:
    """Everything ``kvrouter plan`` reports. Per replica (one TP group): the memory and KV
    figures, ``decode_tokens_per_s_per_seq``, ``ttft_s``, ``request_latency_s``. Whole fleet
    (all ``replicas``): ``prefill_tokens_per_s``, ``decode_tokens_per_s_total``,
    ``max_concurrent_sequences``, ``max_concurrent_users``, ``max_requests_per_s``."""

    inp: PlanInput
    replicas: int
    weights_bytes: int
    weights_bytes_per_gpu: int
    kv_bytes_per_token: int
    kv_bytes_per_token_naive: int
    kv_bytes_per_sequence: int
    kv_bytes_per_sequence_naive: int
    overhead_bytes: int
    memory_budget_bytes_per_gpu: int
    kv_bytes_available_per_gpu: int
    kv_capacity_tokens: int
    kv_capacity_blocks: int
    max_concurrent_sequences: int
    prefill_tokens_per_s: float
    decode_tokens_per_s_per_seq: float
    decode_tokens_per_s_total: float
    spec_tokens_per_step: float
    ttft_s: float
    request_latency_s: float
    max_concurrent_users: int
    max_requests_per_s: float
    fits: bool
    verdict: str
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``kvrouter plan --json``: inputs echoed, then the outputs."""
        inp = self.inp
        out: dict[str, Any] = {
            "model": inp.model.name, "gpu": inp.gpu.name, "num_gpus": inp.num_gpus,
            "tensor_parallel": inp.tensor_parallel, "weight_dtype": inp.weight_dtype,
            "kv_dtype": inp.kv_dtype, "gpu_memory_utilization": inp.gpu_memory_utilization,
            "context": inp.context, "batch_size": inp.batch_size, "prompt_tokens": inp.prompt_tokens,
            "output_tokens": inp.output_tokens, "block_size": inp.block_size,
            "spec_tokens": inp.spec_tokens, "spec_acceptance": inp.spec_acceptance,
            "model_spec": asdict(inp.model),
            "gpu_spec": {"name": inp.gpu.name, "memory_bytes": inp.gpu.memory_bytes,
                         "bandwidth_bytes_per_s": inp.gpu.bandwidth_bytes_per_s, "flops": dict(inp.gpu.flops)},
        }
        for f in fields(self):
            if f.name != "inp":
                value = getattr(self, f.name)
                out[f.name] = list(value) if isinstance(value, tuple) else value
        out["assumptions"] = dict(ASSUMPTIONS)
        return out


ASSUMPTIONS: dict[str, float | int] = {
    "non_torch_bytes": NON_TORCH_BYTES, "profile_tokens": PROFILE_TOKENS, "max_num_seqs": MAX_NUM_SEQS,
    "prefill_efficiency": PREFILL_EFFICIENCY, "bandwidth_efficiency": BANDWIDTH_EFFICIENCY,
    "step_overhead_s": STEP_OVERHEAD_S, "tp_allreduce_s": TP_ALLREDUCE_S,
    "draft_step_cost_ratio": DRAFT_STEP_COST_RATIO, "int4_group_size": INT4_GROUP_SIZE,
}  # echoed in the JSON output (a new dict per call: callers may not mutate the module's)


def _fits(inp: PlanInput) -> bool:
    rl = Roofline(inp)
    return rl.weights_fit and rl.kv_capacity_tokens >= inp.batch_size * inp.context


def _tp_sizes(inp: PlanInput) -> list[int]:
    heads = inp.model.num_attention_heads
    return [tp for tp in (1, 2, 4, 8, 16, 32, 64)
            if inp.tensor_parallel < tp <= MAX_SEARCH_GPUS and heads % tp == 0]


def _verdict(inp: PlanInput, rl: Roofline) -> str:
    """What would make a plan that does not fit fit: more GPUs per replica, a smaller weight
    precision on the same GPUs, or an fp8 KV cache."""
    need = inp.batch_size * inp.context
    if not rl.weights_fit:
        why = (f"weights {rl.weights_bytes_per_gpu / 1e9:.1f} GB + overhead {rl.overhead_bytes / 1e9:.1f} GB "
               f"per GPU exceed the {rl.budget_bytes_per_gpu / 1e9:.1f} GB budget")
    else:
        why = f"KV cache holds {rl.kv_capacity_tokens:,} tokens per replica, {need:,} needed"
    options: list[str] = []
    more = next((tp for tp in _tp_sizes(inp)
                 if _fits(replace(inp, tensor_parallel=tp, num_gpus=tp))), None)
    if more is not None:
        options.append(f"≥ {more} GPUs at {inp.weight_dtype}")
    smaller = [d for d in ("bf16", "fp8", "int8", "int4")
               if WEIGHT_BYTES[d] < WEIGHT_BYTES[inp.weight_dtype]]
    alt = next((d for d in smaller if _fits(replace(inp, weight_dtype=d))), None)
    if alt is not None:
        options.append(alt if options else f"{alt} on {inp.tensor_parallel} GPU(s)")
    else:  # a smaller precision on fewer GPUs than the current one needs (or on some, if none fits)
        fewer = [(tp, d) for d in smaller for tp in _tp_sizes(inp)
                 if (more is None or tp < more) and _fits(replace(inp, weight_dtype=d, tensor_parallel=tp,
                                                                  num_gpus=tp))]
        if fewer:
            tp, d = min(fewer, key=lambda x: (x[0], -WEIGHT_BYTES[x[1]]))
            options.append(f"≥ {tp} GPUs at {d}")
    if inp.kv_dtype != "fp8" and rl.weights_fit and _fits(replace(inp, kv_dtype="fp8")):
        options.append("--kv-dtype fp8")
    if not options:
        return f"does not fit ({why}): not even on {MAX_SEARCH_GPUS} GPUs at {inp.weight_dtype}"
    per = " per replica" if inp.num_gpus > inp.tensor_parallel else ""
    return f"does not fit ({why}): needs {' or '.join(options)}{per}"


def plan(inp: PlanInput) -> PlanResult:
    """Size one deployment: memory, KV capacity, speed and concurrency (see PlanResult)."""
    rl = Roofline(inp)
    replicas = inp.num_gpus // inp.tensor_parallel
    fits = _fits(inp)
    per_request = inp.prompt_tokens + inp.output_tokens
    avg_context = inp.prompt_tokens + inp.output_tokens / 2
    per_seq = rl.decode_tokens_per_s_per_seq(inp.batch_size, int(inp.batch_size * avg_context))
    ttft = rl.prefill_time_s(inp.prompt_tokens)  # the prefill step also samples the first token
    latency = ttft + (inp.output_tokens - 1) / per_seq
    users = min(rl.kv_capacity_tokens // per_request, MAX_NUM_SEQS)
    if users:  # Little's law at that many users per replica, each at its own decode speed
        speed = rl.decode_tokens_per_s_per_seq(users, int(users * avg_context))
        rps = replicas * users / (ttft + (inp.output_tokens - 1) / speed)
    else:
        rps = 0.0
    warnings: list[str] = []
    if inp.context > inp.model.max_position_embeddings:
        warnings.append(f"context {inp.context:,} exceeds the model's max_position_embeddings "
                        f"{inp.model.max_position_embeddings:,}")
    if inp.batch_size > MAX_NUM_SEQS:
        warnings.append(f"batch_size {inp.batch_size} exceeds vLLM's default max_num_seqs {MAX_NUM_SEQS}")
    if fits:
        seqs = rl.kv_capacity_tokens // inp.context
        verdict = (f"fits: {replicas} replica(s) × {inp.tensor_parallel} GPU(s); each KV cache holds "
                   f"{seqs:,} sequence(s) of {inp.context:,} tokens")
    else:
        verdict = _verdict(inp, rl)
    return PlanResult(
        inp=inp, replicas=replicas,
        weights_bytes=rl.weights_bytes, weights_bytes_per_gpu=int(rl.weights_bytes_per_gpu),
        kv_bytes_per_token=rl.kv_bytes_per_token, kv_bytes_per_token_naive=rl.kv_bytes_per_token_naive,
        kv_bytes_per_sequence=rl.kv_bytes_per_token * inp.context,
        kv_bytes_per_sequence_naive=rl.kv_bytes_per_token_naive * inp.context,
        overhead_bytes=rl.overhead_bytes, memory_budget_bytes_per_gpu=rl.budget_bytes_per_gpu,
        kv_bytes_available_per_gpu=max(rl.kv_bytes_available_per_gpu, 0),
        kv_capacity_tokens=rl.kv_capacity_tokens, kv_capacity_blocks=rl.kv_capacity_blocks,
        max_concurrent_sequences=replicas * (rl.kv_capacity_tokens // inp.context),
        prefill_tokens_per_s=replicas * rl.peak_flops * inp.tensor_parallel * PREFILL_EFFICIENCY
        / rl.flops_per_token,
        decode_tokens_per_s_per_seq=per_seq,
        decode_tokens_per_s_total=replicas * inp.batch_size * per_seq,
        spec_tokens_per_step=rl.spec_tokens_per_step(),
        ttft_s=ttft, request_latency_s=latency,
        max_concurrent_users=replicas * users, max_requests_per_s=rps,
        fits=fits, verdict=verdict, warnings=tuple(warnings),
    )
