"""``kvrouter trace``: trace tools.

- ``kvrouter trace stats FILE`` prints the shape of a trace: requests, duration and rate,
  prompt and output lengths, blocks, sessions, and the ideal prefix hit rates (infinite
  shared cache; one pooled LRU cache per ``--capacity-blocks`` value, or sized from a
  fleet with ``--replicas/--gpu/--model``).
- ``kvrouter trace generate KIND --out FILE`` writes a seeded synthetic workload
  (tenants, multi_turn, rag, agentic, mixed) as Mooncake JSONL.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from loadtest.hitrate import ideal_infinite, ideal_pooled_lru
from loadtest.summary import distribution
from loadtest.traces.formats import FORMATS, load_trace, write_mooncake
from loadtest.traces.generators import GENERATORS, generate
from loadtest.traces.types import TraceFormatError, TraceRequest


def trace_stats(requests: list[TraceRequest], capacities: list[int]) -> dict[str, Any]:
    """The shape of a trace as one JSON-able object (pure)."""
    n = len(requests)
    dur = requests[-1].timestamp_s - requests[0].timestamp_s if n else 0.0
    all_ids = [h for r in requests for h in r.hash_ids]
    inf = ideal_infinite(requests)
    sessions = {r.session_id for r in requests if r.session_id is not None}
    out: dict[str, Any] = {
        "requests": n,
        "duration_s": dur,
        "rate_rps": (n - 1) / dur if dur > 0 else 0.0,
        "block_size": requests[0].block_size if n else 0,
        "input_length": distribution(r.input_length for r in requests),
        "output_length": distribution(r.output_length for r in requests),
        "prompt_tokens": sum(r.input_length for r in requests),
        "output_tokens": sum(r.output_length for r in requests),
        "blocks": len(all_ids),
        "distinct_blocks": len(set(all_ids)),
        "sessions": len(sessions),
        "ideal_infinite_hit_rate": inf.token_rate,
        "ideal_infinite_block_hit_rate": inf.block_rate,
        "ideal_pooled": [],
    }
    for c in capacities:
        s = ideal_pooled_lru(requests, c)
        out["ideal_pooled"].append({"capacity_blocks": c, "hit_rate": s.token_rate,
                                    "block_hit_rate": s.block_rate})
    return out


def fleet_capacity_blocks(replicas: int, gpu: str, model: str, block_size: int) -> int:
    """KV capacity of a fleet, in trace blocks, from the capacity planner."""
    from backends.planner import PlanInput, Roofline, get_gpu, get_model

    roof = Roofline(PlanInput(model=get_model(model), gpu=get_gpu(gpu)))
    tokens = roof.kv_capacity_blocks * PlanInput.block_size * replicas
    return tokens // block_size


def _render(st: dict[str, Any]) -> str:
    def d(x: dict[str, float]) -> str:
        return (f"mean {x['mean']:,.0f}  p50 {x['p50']:,.0f}  p90 {x['p90']:,.0f}  "
                f"p99 {x['p99']:,.0f}  max {x['max']:,.0f}")
    lines = [
        f"requests        {st['requests']:,} over {st['duration_s']:,.1f} s ({st['rate_rps']:.2f} req/s)",
        f"input tokens    {d(st['input_length'])}  (total {st['prompt_tokens']:,})",
        f"output tokens   {d(st['output_length'])}  (total {st['output_tokens']:,})",
        f"blocks          {st['blocks']:,} of {st['block_size']} tokens, {st['distinct_blocks']:,} distinct",
        f"sessions        {st['sessions']:,}",
        f"ideal hit rate  infinite cache: {st['ideal_infinite_hit_rate']:.3f} of tokens "
        f"({st['ideal_infinite_block_hit_rate']:.3f} of blocks)",
    ]
    for p in st["ideal_pooled"]:
        lines.append(f"                pooled LRU of {p['capacity_blocks']:,} blocks: {p['hit_rate']:.3f} "
                     f"of tokens ({p['block_hit_rate']:.3f} of blocks)")
    return "\n".join(lines)


def _capacities(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated integers, e.g. 1000,10000") from None
    if any(c < 0 for c in out):
        raise argparse.ArgumentTypeError("capacities must be >= 0")
    return out


def _param(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError("expected KEY=VALUE")
    k, v = text.split("=", 1)
    try:
        val: Any = json.loads(v)
    except json.JSONDecodeError:
        val = v
    if isinstance(val, list):
        val = tuple(val)
    return k.strip(), val


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvrouter trace", description="trace tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stats", help="print the shape of a trace and its ideal hit rates")
    s.add_argument("file")
    s.add_argument("--format", default="auto", choices=["auto", *FORMATS],
                   help="trace format (default: sniffed from the first record)")
    s.add_argument("--block-size", type=int, default=None,
                   help="tokens per hash id (default: mooncake: the file's block_size field, else 512; "
                        "bailian 16, openai 16)")
    s.add_argument("--limit", type=int, default=None, help="read only the first N requests")
    s.add_argument("--capacity-blocks", type=_capacities, default=[],
                   help="pooled-LRU capacities in trace blocks, comma-separated")
    s.add_argument("--replicas", type=int, default=None, help="size the pooled LRU from a fleet ...")
    s.add_argument("--gpu", default="h100-80gb", help="... of this GPU preset")
    s.add_argument("--model", default="llama-3.1-8b", help="... serving this model")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    g = sub.add_parser("generate", help="write a seeded synthetic trace as Mooncake JSONL")
    g.add_argument("kind", choices=sorted(GENERATORS))
    g.add_argument("--out", required=True, help="output file (Mooncake JSONL)")
    g.add_argument("--seed", type=int, default=0, help="same seed and parameters, same trace")
    g.add_argument("--block-size", type=int, default=16, help="tokens per hash id")
    g.add_argument("--param", type=_param, action="append", default=[],
                   help="generator argument KEY=VALUE (JSON values; lists become ranges)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "generate":
            kwargs = dict(args.param)
            reqs = generate(args.kind, seed=args.seed, block_size=args.block_size, **kwargs)
            n = write_mooncake(reqs, args.out)
            print(f"wrote {n} requests to {args.out} (Mooncake JSONL, {args.block_size}-token blocks, "
                  "recorded in each line's block_size field)")
            return 0
        reqs = load_trace(args.file, args.format, args.block_size, args.limit)
        caps = list(args.capacity_blocks)
        if args.replicas:
            caps.append(fleet_capacity_blocks(args.replicas, args.gpu, args.model,
                                              reqs[0].block_size if reqs else 512))
        st = trace_stats(reqs, caps)
    except (OSError, TraceFormatError, ValueError, TypeError) as exc:
        print(f"kvrouter trace: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(st, indent=2) if args.json else _render(st))
    return 0
