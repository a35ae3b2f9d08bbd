"""``kvrouter plan``: the capacity planner's command line (argument parsing and printing only;
the formulas live in :mod:`backends.planner`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from backends.planner import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    GPU_PRESETS,
    KV_DTYPES,
    MODEL_PRESETS,
    WEIGHT_BYTES,
    PlanInput,
    PlannerError,
    PlanResult,
    get_gpu,
    get_model,
    plan,
)

PROG = "kvrouter plan"


def _count(text: str) -> int:
    """A token count: ``131072``, ``131_072`` or ``128k`` (k = 1024)."""
    t = text.strip().lower().replace("_", "").replace(",", "")
    try:
        return int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (use e.g. 8192 or 128k)") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Capacity planner: GPU memory (weights, KV cache, overhead), KV capacity, "
        "prefill/decode speed, latency and concurrent users for one model on one GPU type. "
        "Figures are roofline estimates; assumptions are listed in docs/planner.md and in --json.",
        epilog="example: kvrouter plan --model llama-3.1-8b --gpu a100-40gb --dtype fp16 --context 128k --json",
    )
    p.add_argument("--model", "-m", default="llama-3.1-8b", metavar="NAME|PATH",
                   help=f"model preset ({', '.join(MODEL_PRESETS)}) or a path to a Hugging Face "
                   "config.json (or a directory holding one) (default: %(default)s)")
    p.add_argument("--gpu", "-g", default="a100-80gb",
                   help=f"GPU type: {', '.join(GPU_PRESETS)} (default: %(default)s)")
    p.add_argument("--num-gpus", "-n", type=int, default=None, metavar="N",
                   help="GPUs in the deployment; replicas = N / tensor-parallel (default: the TP size)")
    p.add_argument("--tensor-parallel", "--tp", "-tp", type=int, default=1, metavar="TP", dest="tensor_parallel",
                   help="tensor-parallel size: GPUs per replica; must divide the attention heads (default: 1)")
    p.add_argument("--dtype", "--weight-dtype", default="bf16", dest="dtype", metavar="DTYPE",
                   help=f"weight precision: {', '.join(WEIGHT_BYTES)}; int4 means AWQ/GPTQ with "
                   "group-128 scales and zero points (default: %(default)s)")
    p.add_argument("--kv-dtype", "--kv-cache-dtype", default="auto", dest="kv_dtype", metavar="DTYPE",
                   help=f"KV cache dtype: {', '.join(KV_DTYPES)}; auto = the activation dtype "
                   "(2 bytes; 4 for fp32 models), fp8 = 1 byte (default: %(default)s)")
    p.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                   metavar="F", help="share of GPU memory the engine may use, as vLLM's flag (default: %(default)s)")
    p.add_argument("--context", "--max-model-len", type=_count, default=8192, metavar="TOKENS",
                   help="context length of one sequence (max_model_len); 'fits' needs batch-size "
                   "sequences of this length in the KV cache; accepts 128k (default: %(default)s)")
    p.add_argument("--batch-size", "-b", type=int, default=1, metavar="B",
                   help="concurrent sequences per replica for the decode-speed figures (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=_count, default=1024, metavar="TOKENS",
                   help="average prompt length per request (default: %(default)s)")
    p.add_argument("--output-tokens", type=_count, default=256, metavar="TOKENS",
                   help="average generated tokens per request (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16, metavar="TOKENS",
                   help="KV cache block (page) size in tokens, vLLM's --block-size (default: %(default)s)")
    p.add_argument("--spec-tokens", type=int, default=0, metavar="K",
                   help="speculative decoding: draft tokens proposed per step (default: 0 = off)")
    p.add_argument("--spec-acceptance", type=float, default=0.0, metavar="A",
                   help="speculative decoding: probability each draft token is accepted, 0-1 (default: 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object (inputs, outputs, assumptions)")
    p.add_argument("--list", action="store_true", help="list the model and GPU presets and exit")
    return p


def _bytes(n: float) -> str:
    return f"{n / 1e9:,.2f} GB ({n / (1 << 30):,.2f} GiB)"


def _kib(n: float) -> str:
    return f"{n:,.0f} B ({n / 1024:,.1f} KiB)"


def _presets_text() -> str:
    lines = ["models:"]
    for name, m in MODEL_PRESETS.items():
        moe = f", MoE {m.num_experts}x top-{m.experts_per_token}" if m.num_experts > 1 else ""
        lines.append(f"  {name:<14} {m.total_params / 1e9:6.2f}B params, {m.num_layers} layers, "
                     f"hidden {m.hidden_size}, {m.num_kv_heads}/{m.num_attention_heads} KV/attn heads{moe}")
    lines.append("gpus:")
    for name, g in GPU_PRESETS.items():
        lines.append(f"  {name:<14} {g.memory_bytes / (1 << 30):6.1f} GiB, {g.bandwidth_bytes_per_s / 1e9:,.0f} GB/s, "
                     f"bf16 {g.flops['bf16'] / 1e12:,.0f} / fp8 {g.flops['fp8'] / 1e12:,.0f} / "
                     f"int8 {g.flops['int8'] / 1e12:,.0f} TFLOP/s")
    return "\n".join(lines)


_SPEED_ROWS = frozenset({"prefill", "decode per sequence", "decode total", "time to first token", "request latency"})


def format_table(r: PlanResult) -> str:
    """The human-readable report (the same figures as --json)."""
    i = r.inp
    spec = f", speculative k={i.spec_tokens} a={i.spec_acceptance}" if i.spec_tokens else ""
    rows: list[tuple[str, Any]] = [
        ("model", f"{i.model.name} ({i.model.total_params / 1e9:.2f}B params, "
                  f"{i.model.active_params / 1e9:.2f}B active)"),
        ("gpus", f"{i.num_gpus} × {i.gpu.name}, tensor parallel {i.tensor_parallel} → {r.replicas} replica(s)"),
        ("precision", f"weights {i.weight_dtype}, KV cache {i.kv_dtype}, "
                      f"gpu_memory_utilization {i.gpu_memory_utilization}"),
        ("workload", f"context {i.context:,}, batch {i.batch_size}, prompt {i.prompt_tokens:,} + "
                     f"output {i.output_tokens:,} tokens, block {i.block_size}{spec}"),
        ("", ""),
        ("weights (whole model)", _bytes(r.weights_bytes)),
        ("weights per GPU", _bytes(r.weights_bytes_per_gpu)),
        ("overhead per GPU", _bytes(r.overhead_bytes) + "  activations, workspace, CUDA context"),
        ("memory budget per GPU", _bytes(r.memory_budget_bytes_per_gpu)),
        ("left for KV cache per GPU", _bytes(r.kv_bytes_available_per_gpu)),
        ("", ""),
        ("KV per token (GQA)", _kib(r.kv_bytes_per_token) + "  2 × layers × KV heads × head_dim × bytes"),
        ("KV per token (naive)", _kib(r.kv_bytes_per_token_naive) + "  2 × layers × hidden × bytes, ignores GQA"),
        (f"KV per sequence @ {i.context:,}", _bytes(r.kv_bytes_per_sequence)),
        (f"  naive @ {i.context:,}", _bytes(r.kv_bytes_per_sequence_naive)),
        ("KV capacity per replica", f"{r.kv_capacity_tokens:,} tokens = {r.kv_capacity_blocks:,} blocks "
                                    f"of {i.block_size}"),
        ("max concurrent sequences", f"{r.max_concurrent_sequences:,} at {i.context:,} tokens (all replicas)"),
        ("", ""),
        ("prefill", f"{r.prefill_tokens_per_s:,.0f} tokens/s (all replicas, compute-bound)"),
        ("decode per sequence", f"{r.decode_tokens_per_s_per_seq:,.1f} tokens/s at batch {i.batch_size} "
                                f"({r.spec_tokens_per_step:.2f} tokens/step)"),
        ("decode total", f"{r.decode_tokens_per_s_total:,.1f} tokens/s (all replicas)"),
        ("time to first token", f"{r.ttft_s * 1e3:,.1f} ms"),
        ("request latency", f"{r.request_latency_s:,.2f} s"),
        ("max concurrent users", f"{r.max_concurrent_users:,} (prompt + output resident, ≤ max_num_seqs per "
                                 f"replica) → {r.max_requests_per_s:,.1f} requests/s"),
        ("", ""),
        ("fits", "yes" if r.fits else "NO"),
        ("verdict", r.verdict),
    ]
    if not r.fits:  # the speed rows describe the plan as if it fitted
        rows = [(k, f"{v}  (if it fitted)" if k in _SPEED_ROWS else v) for k, v in rows]
    rows += [("warning", w) for w in r.warnings]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}".rstrip() for k, v in rows)


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return int(exc.code or 0)
    if args.list:
        print(_presets_text())
        return 0
    try:
        inp = PlanInput(
            model=get_model(args.model), gpu=get_gpu(args.gpu),
            num_gpus=args.num_gpus if args.num_gpus is not None else args.tensor_parallel,
            tensor_parallel=args.tensor_parallel, weight_dtype=args.dtype.lower(),
            kv_dtype=args.kv_dtype.lower(), gpu_memory_utilization=args.gpu_memory_utilization,
            context=args.context, batch_size=args.batch_size, prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens, block_size=args.block_size,
            spec_tokens=args.spec_tokens, spec_acceptance=args.spec_acceptance,
        )
        result = plan(inp)
    except PlannerError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
