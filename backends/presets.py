"""Model and GPU descriptions for the capacity planner: the spec types, built-in presets,
and the reader that turns a Hugging Face ``config.json`` into a :class:`ModelSpec`.

Pure data and pure functions, except :func:`get_model`, which reads a file when given a path.
Preset parameter counts are the ones the model cards publish (Llama 3.1 8B is "8B", so
8.0e9 — the figure the worked examples use); a ``config.json`` is counted layer by layer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

GiB = 1 << 30
MiB = 1 << 20


class PlannerError(ValueError):
    """Bad planner input (unknown preset, unreadable config, value out of range)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # per expert for MoE models
    vocab_size: int
    total_params: float  # parameters held in memory
    active_params: float  # parameters touched per token (MoE: < total)
    num_experts: int = 1
    experts_per_token: int = 1
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False  # input embedding shared with the LM head

    @property
    def embedding_params(self) -> float:
        """Embedding + LM head parameters (kept at 16 bit by weight-only quantization)."""
        return float(self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2))


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    flops: Mapping[str, float]  # "fp32", "bf16", "fp8", "int8": dense peak FLOP/s (no sparsity)


def _gpu(name: str, mem_mib: int, bw_gb_s: float, fp32: float, bf16: float, fp8: float, int8: float) -> GPUSpec:
    flops = MappingProxyType({"fp32": fp32 * 1e12, "bf16": bf16 * 1e12, "fp8": fp8 * 1e12, "int8": int8 * 1e12})
    return GPUSpec(name, mem_mib * MiB, bw_gb_s * 1e9, flops)


# Memory: total as nvidia-smi reports it (MiB). Bandwidth and dense (non-sparse) tensor FLOP/s:
# NVIDIA datasheets (A100 SXM, H100 SXM, H200 SXM, L4). "fp32" is TF32 tensor-core math.
# GPUs without FP8 tensor cores (A100) list fp8 at the bf16 rate: vLLM runs FP8 checkpoints
# there as weight-only (Marlin) kernels, which compute in 16 bit.
GPU_PRESETS: Mapping[str, GPUSpec] = MappingProxyType(
    {
        "a100-40gb": _gpu("a100-40gb", 40960, 1555, 156, 312, 312, 624),
        "a100-80gb": _gpu("a100-80gb", 81920, 2039, 156, 312, 312, 624),
        "h100-80gb": _gpu("h100-80gb", 81559, 3350, 495, 989, 1979, 1979),
        "h200": _gpu("h200", 143771, 4800, 495, 989, 1979, 1979),
        "l4": _gpu("l4", 23034, 300, 60, 121, 242, 242),
    }
)


def _dense(name: str, params: float, layers: int, hidden: int, heads: int, kv: int, hd: int, inter: int,
           vocab: int, max_pos: int, tied: bool = False) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, kv, hd, inter, vocab, params, params,
                     max_position_embeddings=max_pos, tie_word_embeddings=tied)


# Architecture from each model's config.json on the Hugging Face hub; params from its card.
MODEL_PRESETS: Mapping[str, ModelSpec] = MappingProxyType(
    {
        "llama-3.1-8b": _dense("llama-3.1-8b", 8.0e9, 32, 4096, 32, 8, 128, 14336, 128256, 131072),
        "llama-3.1-70b": _dense("llama-3.1-70b", 70e9, 80, 8192, 64, 8, 128, 28672, 128256, 131072),
        "llama-2-13b": _dense("llama-2-13b", 13e9, 40, 5120, 40, 40, 128, 13824, 32000, 4096),
        "llama-3.2-1b": _dense("llama-3.2-1b", 1.24e9, 16, 2048, 32, 8, 64, 8192, 128256, 131072, True),
        "llama-3.2-3b": _dense("llama-3.2-3b", 3.21e9, 28, 3072, 24, 8, 128, 8192, 128256, 131072, True),
        "qwen2.5-7b": _dense("qwen2.5-7b", 7.61e9, 28, 3584, 28, 4, 128, 18944, 152064, 32768),
        "mixtral-8x7b": ModelSpec("mixtral-8x7b", 32, 4096, 32, 8, 128, 14336, 32000, 46.7e9, 12.9e9,
                                  num_experts=8, experts_per_token=2, max_position_embeddings=32768),
    }
)


def _get(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def model_from_config(cfg: Mapping[str, Any], name: str = "custom") -> ModelSpec:
    """A :class:`ModelSpec` from a Hugging Face config dict, parameters counted per layer.

    Counts: embeddings (+ LM head unless tied), per layer q/k/v/o projections (+ q/k/v bias
    for Qwen2 or ``attention_bias``), a gated MLP of 3 × hidden × intermediate per expert,
    the MoE router and shared expert when present, and the RMSNorm weights.
    """
    if isinstance(cfg.get("text_config"), Mapping):  # multimodal wrappers keep the LM here
        cfg = {**cfg, **cfg["text_config"]}
    try:
        layers = int(_get(cfg, "num_hidden_layers", "n_layer", "num_layers"))
        hidden = int(_get(cfg, "hidden_size", "n_embd", "d_model"))
        heads = int(_get(cfg, "num_attention_heads", "n_head"))
        vocab = int(cfg["vocab_size"])
    except (TypeError, KeyError, ValueError) as exc:
        raise PlannerError(
            f"config {name!r} lacks num_hidden_layers / hidden_size / num_attention_heads / vocab_size"
        ) from exc
    kv = int(_get(cfg, "num_key_value_heads", "num_kv_heads", default=heads))
    hd = int(_get(cfg, "head_dim", default=hidden // heads))
    experts = int(_get(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=1))
    topk = int(_get(cfg, "num_experts_per_tok", "moe_topk", default=1)) if experts > 1 else 1
    dense_inter = int(_get(cfg, "intermediate_size", "n_inner", default=4 * hidden))
    inter = int(_get(cfg, "moe_intermediate_size", default=dense_inter)) if experts > 1 else dense_inter
    shared_inter = int(_get(cfg, "shared_expert_intermediate_size", default=0))
    shared_inter += int(_get(cfg, "n_shared_experts", default=0)) * inter
    tied = bool(cfg.get("tie_word_embeddings", False))
    bias = bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2"

    attn = hidden * heads * hd * 2 + hidden * kv * hd * 2 + (((heads + 2 * kv) * hd) if bias else 0)
    expert = 3 * hidden * inter
    shared = 3 * hidden * shared_inter + (hidden if shared_inter else 0)
    router = hidden * experts if experts > 1 else 0
    norms = 2 * hidden
    embed = vocab * hidden * (1 if tied else 2)
    total = embed + hidden + layers * (attn + experts * expert + shared + router + norms)
    active = embed + hidden + layers * (attn + topk * expert + shared + router + norms)
    return ModelSpec(
        name=name, num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_kv_heads=kv,
        head_dim=hd, intermediate_size=inter, vocab_size=vocab, total_params=float(total),
        active_params=float(active), num_experts=experts, experts_per_token=topk,
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", "n_positions", default=131072)),
        tie_word_embeddings=tied,
    )


def get_model(name_or_path: str) -> ModelSpec:
    """A preset by name (case-insensitive), or a ``config.json`` path (or a directory holding one)."""
    key = name_or_path.strip().lower()
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlannerError(
            f"unknown model {name_or_path!r}: not a preset ({', '.join(MODEL_PRESETS)}) "
            "and not a path to a Hugging Face config.json"
        )
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlannerError(f"cannot read model config {str(path)!r}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise PlannerError(f"model config {str(path)!r} is not a JSON object")
    label = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return model_from_config(cfg, name=label or "custom")


def get_gpu(name: str) -> GPUSpec:
    """A GPU preset by name (case-insensitive; ``h100`` and ``a100`` name the 80 GB parts)."""
    key = name.strip().lower()
    key = {"h100": "h100-80gb", "a100": "a100-80gb", "h200-141gb": "h200", "l4-24gb": "l4"}.get(key, key)
    if key not in GPU_PRESETS:
        raise PlannerError(f"unknown GPU {name!r}; known GPUs: {', '.join(GPU_PRESETS)}")
    return GPU_PRESETS[key]

