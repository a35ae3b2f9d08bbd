"""``kvrouter sim``: run one simulated vLLM-compatible GPU engine over HTTP.

Options become objects here only: the planner's :class:`~backends.planner.Roofline` (KV
capacity and step costs for the model/GPU/precision), the :class:`EngineConfig`, the
tokenizer and the :class:`SimServer`. ``build_server(argv)`` does all of it without
starting anything (tests use it in-process); ``main(argv)`` serves.
"""

from __future__ import annotations

import argparse
import logging
import sys

from backends.planner import (
    GPU_PRESETS,
    KV_DTYPES,
    MODEL_PRESETS,
    WEIGHT_BYTES,
    PlanInput,
    PlannerError,
    Roofline,
    get_gpu,
    get_model,
)
from backends.sim.engine import EngineConfig, EngineModel, make_tape
from backends.sim.server import SimServer
from backends.sim.tokenizer import SimTokenizer

PROG = "kvrouter sim"
DEFAULT_MODEL_CONFIG = "llama-3.1-8b"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="One simulated GPU engine speaking vLLM's OpenAI API and /metrics: paged KV "
        "cache with prefix caching and LRU eviction, continuous batching with chunked prefill, "
        "step times from the capacity planner's roofline for --model-config on --gpu.",
        epilog="example: kvrouter sim --port 8001 --model llama-3.1-8b --gpu a100-80gb --time-scale 0.1",
    )
    a = p.add_argument
    a("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    a("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    a("--model", default="llama-3.1-8b",
      help="served model name (the `model` requests must name); also the planner preset when "
      "--model-config is not given and this is a preset name (default: %(default)s)")
    a("--model-config", default=None, metavar="NAME|PATH",
      help=f"planner model: a preset ({', '.join(MODEL_PRESETS)}) or a Hugging Face config.json "
      f"path or directory (default: --model if it is a preset, else {DEFAULT_MODEL_CONFIG})")
    a("--gpu", default="a100-80gb", help=f"GPU type: {', '.join(GPU_PRESETS)} (default: %(default)s)")
    a("--tensor-parallel", "--tp", dest="tensor_parallel", type=int, default=1,
      help="GPUs per replica (tensor parallel); KV capacity is per replica (default: %(default)s)")
    a("--dtype", default="bf16", help=f"weight precision: {', '.join(WEIGHT_BYTES)} (default: %(default)s)")
    a("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype", default="auto",
      help=f"KV cache dtype: {', '.join(KV_DTYPES)}; fp8 halves bytes per token, doubling the "
      "block count (default: %(default)s)")
    a("--gpu-memory-utilization", type=float, default=0.9,
      help="share of GPU memory for weights + KV + overhead, as vLLM (default: %(default)s)")
    a("--num-blocks", type=int, default=None,
      help="KV blocks (overrides the planner's capacity; handy to force eviction in tests)")
    a("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    a("--max-model-len", type=int, default=None,
      help="longest prompt + output in tokens (default: the model's context, capped by the KV capacity)")
    a("--max-num-seqs", type=int, default=256, help="most requests in one batch (default: %(default)s)")
    a("--max-num-batched-tokens", type=int, default=8192,
      help="token budget of one step; longer prefills are chunked (default: %(default)s)")
    a("--no-prefix-caching", action="store_true", help="disable prefix caching (every prompt is computed)")
    a("--spec-tokens", type=int, default=0,
      help="speculative decoding: k draft tokens per step (default: %(default)s = off)")
    a("--spec-acceptance", type=float, default=0.0,
      help="speculative decoding: per-token acceptance probability a in [0, 1) (default: %(default)s)")
    a("--time-scale", type=float, default=1.0,
      help="wall seconds per simulated second: 1 = real time, 0.01 = 100x faster, 0 = no waiting "
      "at all (default: %(default)s)")
    a("--seed", type=int, default=0, help="seed of the generated text and of spec-decode acceptance "
      "(default: %(default)s)")
    a("--tokenizer", default=None, metavar="PATH",
      help="a local Hugging Face tokenizer.json (default: the built-in byte-level tokenizer)")
    a("--default-max-tokens", type=int, default=0,
      help="max_tokens when a request gives none (default: 0 = vLLM's: 16 for completions, the "
      "rest of the context for chat)")
    a("--kv-events-config", default=None, metavar="JSON",
      help='publish KV-cache events like vLLM, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
      '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "", "encoding": "map"}\' '
      '(encoding: map = newer vLLM, array = older vLLM / SGLang; see docs/kv-events.md)')
    a("--prefix-hash", choices=("builtin", "vllm"), default="builtin",
      help="block hashes of the prefix cache (and of its KV events): builtin = the router's xxh3 chain, "
      "vllm = vLLM's sha256 chain (default: %(default)s)")
    a("--log-level", default="warning", help="logging level (default: %(default)s)")
    return p


def build_server(argv: list[str]) -> tuple[SimServer, argparse.Namespace]:
    """Parse ``argv`` and build the server (raises SystemExit on bad options)."""
    p = build_parser()
    args = p.parse_args(argv)
    for flag, value, low in (("--num-blocks", args.num_blocks, 1), ("--block-size", args.block_size, 1),
                             ("--max-num-seqs", args.max_num_seqs, 1),
                             ("--max-num-batched-tokens", args.max_num_batched_tokens, 1),
                             ("--tensor-parallel", args.tensor_parallel, 1), ("--max-model-len", args.max_model_len, 2),
                             ("--default-max-tokens", args.default_max_tokens, 0), ("--port", args.port, 0)):
        if value is not None and value < low:
            p.error(f"{flag} must be >= {low}, got {value}")
    if args.port > 65535:
        p.error(f"--port must be <= 65535, got {args.port}")
    if not 0 < args.gpu_memory_utilization <= 1:
        p.error(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.time_scale < 0:
        p.error("--time-scale must be >= 0")
    if args.spec_tokens < 0 or not 0 <= args.spec_acceptance < 1:
        p.error("--spec-tokens must be >= 0 and --spec-acceptance in [0, 1)")
    cfg_name = args.model_config or (args.model if args.model.lower() in MODEL_PRESETS else DEFAULT_MODEL_CONFIG)
    try:
        model = get_model(cfg_name)
        inp = PlanInput(model=model, gpu=get_gpu(args.gpu), num_gpus=args.tensor_parallel,
                        tensor_parallel=args.tensor_parallel, weight_dtype=args.dtype, kv_dtype=args.kv_dtype,
                        gpu_memory_utilization=args.gpu_memory_utilization, block_size=args.block_size,
                        spec_tokens=args.spec_tokens, spec_acceptance=args.spec_acceptance)
        roofline = Roofline(inp)
    except PlannerError as e:
        p.error(str(e))
    num_blocks = args.num_blocks if args.num_blocks is not None else int(roofline.kv_capacity_blocks)
    if num_blocks < 1:
        p.error(f"{model.name} at {args.dtype} does not fit on {args.gpu} x{args.tensor_parallel}: "
                "no memory left for the KV cache (try `kvrouter plan`, --dtype int4 or --tensor-parallel)")
    # one request alone must always fit: keep a block (plus spec lookahead) of headroom
    capacity = num_blocks * args.block_size - args.block_size * (1 + -(-args.spec_tokens // args.block_size))
    max_len = args.max_model_len or min(model.max_position_embeddings, capacity)
    if max_len < 2 or max_len > capacity:
        p.error(f"--max-model-len {max_len} must be in [2, {capacity}] for {num_blocks} blocks of "
                f"{args.block_size} tokens")
    tok = SimTokenizer(args.tokenizer)
    kv_events = None
    if args.kv_events_config:
        from backends.sim.kv_publisher import KVEventPublisher, KVEventsConfig

        try:
            kv_cfg = KVEventsConfig.from_json(args.kv_events_config)
        except (ValueError, TypeError) as e:
            p.error(str(e))
        kv_events = KVEventPublisher(kv_cfg) if kv_cfg.enabled else None
    extra: dict[str, object] = {"record_kv_events": kv_events is not None}
    if args.prefix_hash == "vllm":
        from backends.kv_events import VllmBlockHasher

        extra["hasher"] = VllmBlockHasher()
    config = EngineConfig(num_blocks=num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len,
                          enable_prefix_caching=not args.no_prefix_caching, spec_tokens=args.spec_tokens,
                          spec_acceptance=args.spec_acceptance, model=args.model, seed=args.seed,
                          output_tape=make_tape(args.seed, tok.char_id), **extra)
    info = {"gpu": args.gpu, "dtype": args.dtype, "kv_dtype": args.kv_dtype,
            "tensor_parallel": args.tensor_parallel, "gpu_memory_utilization": args.gpu_memory_utilization,
            "model_config": model.name, "time_scale": args.time_scale,
            "kv_bytes_per_token": int(roofline.kv_bytes_per_token)}
    server = SimServer(EngineModel(config, roofline), tok, served=(args.model,), time_scale=args.time_scale,
                       root=model.name, info=info, default_max_tokens=args.default_max_tokens,
                       kv_publisher=kv_events)
    return server, args


def main(argv: list[str] | None = None) -> int:
    server, args = build_server(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from backends.sim.conn import serve

    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - non-Linux
        import asyncio

        loop = asyncio.new_event_loop()
    cfg = server.engine.config
    print(f"{PROG}: {args.model} on {args.gpu} ({args.dtype}, kv {args.kv_dtype}): {cfg.num_blocks} blocks of "
          f"{cfg.block_size} tokens, max_model_len {cfg.max_model_len}, time scale {args.time_scale}; "
          f"http://{args.host}:{args.port}", flush=True)
    try:
        loop.run_until_complete(serve(server.make_app(), args.host, args.port))
    except OSError as e:  # e.g. the port is taken
        print(f"{PROG}: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
