"""``kvrouter replay TRACE``: replay a trace live against an endpoint, or offline in virtual time.

Live (``--target URL``): see :mod:`loadtest.live`. Per-request records go to ``--out``
(JSONL), the summary to stdout (``--json`` for one object), a progress bar to stderr.

Offline (``--offline``): see :mod:`loadtest.offline` — a discrete-event simulation of
``--replicas`` simulated engines (``--gpu``, ``--model``) behind the router's own policy
code, one run per policy of ``--policies``, compared with the trace's ideal hit rates.

Bad arguments or an unreadable trace: a message on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from contextlib import ExitStack
from typing import Any

from loadtest.traces.formats import FORMATS, load_trace
from loadtest.traces.types import TraceFormatError, TraceRequest


def _opt(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError("expected KEY=VALUE")
    k, v = text.split("=", 1)
    try:
        return k.strip(), json.loads(v)
    except json.JSONDecodeError:
        return k.strip(), v


def _positive(kind: type) -> Any:
    def conv(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError("must be > 0")
        return v
    return conv


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvrouter replay",
        description="Replay a trace live (--target URL) or offline in virtual time (--offline).")
    p.add_argument("trace", help="trace file: Mooncake, Bailian-style or OpenAI-body JSONL")
    p.add_argument("--format", default="auto", choices=["auto", *FORMATS],
                   help="trace format (default: sniffed from the first record)")
    p.add_argument("--block-size", type=_positive(int), default=None,
                   help="tokens per trace hash id (default: mooncake: the file's block_size field, "
                        "else 512; bailian/openai 16)")
    p.add_argument("--limit", type=_positive(int), default=None, help="replay only the first N requests")
    p.add_argument("--speed", type=_positive(float), default=1.0,
                   help="time scale: 10 sends the trace 10x faster (offline: arrivals compressed alike)")
    p.add_argument("--seed", type=int, default=0, help="prompt content and policy randomness")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    live = p.add_argument_group("live replay")
    live.add_argument("--target", help="OpenAI-compatible base URL (router or engine), e.g. http://127.0.0.1:8000")
    live.add_argument("--model", default=None,
                      help="model name (live: default the target's first model; offline: planner preset, "
                           "default llama-3.1-8b)")
    live.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                      help="API for prompts built from hash ids (OpenAI-body traces keep their own)")
    live.add_argument("--prompt-mode", default="auto", choices=["auto", "text", "tokens"],
                      help="auto: send one token-id prompt first and use token ids if the target accepts "
                           "it, else text (chat: text); text: ASCII text (block-exact with the byte "
                           "tokenizer); tokens: token-id prompts (default: %(default)s)")
    live.add_argument("--max-concurrency", type=_positive(int), default=256,
                      help="most requests in flight; a full window delays the next send")
    live.add_argument("--duration", type=_positive(float), default=None,
                      help="send nothing after this many seconds")
    live.add_argument("--timeout", type=_positive(float), default=600.0, help="per-request timeout (s)")
    live.add_argument("--max-output-tokens", type=_positive(int), default=None,
                      help="cap each request's output length")
    live.add_argument("--replica-header", default="x-kvrouter-replica",
                      help="response header naming the replica that served the request")
    live.add_argument("--engine-metrics", nargs="+", default=[], metavar="URL",
                      help="engine /metrics URLs to scrape before and after (prefix-cache deltas); "
                           "'auto': the replicas a kvrouter target lists at /admin/replicas (needs --admin-key)")
    live.add_argument("--api-key", default=os.environ.get("KVROUTER_API_KEY"),
                      help="bearer token (default $KVROUTER_API_KEY)")
    live.add_argument("--admin-key", default=os.environ.get("KVROUTER_ADMIN_KEY"),
                      help="kvrouter admin key for --engine-metrics auto (default $KVROUTER_ADMIN_KEY)")
    live.add_argument("--no-vllm-extensions", action="store_true",
                      help="do not send ignore_eos/min_tokens (strict OpenAI servers)")
    live.add_argument("--out", default=None, help="write per-request records here (JSONL)")
    live.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                      help="progress bar on stderr (default: when stderr is a terminal)")
    off = p.add_argument_group("offline replay")
    off.add_argument("--offline", action="store_true", help="simulate the fleet in virtual time")
    off.add_argument("--replicas", type=_positive(int), default=8, help="simulated engines")
    off.add_argument("--gpu", default="h100-80gb", help="GPU preset")
    off.add_argument("--policy", default=None, help="one policy (default cache_aware)")
    off.add_argument("--policies", default=None, help="comma-separated policies to compare")
    off.add_argument("--policy-option", type=_opt, action="append", default=[],
                     help="policy option KEY=VALUE (repeatable)")
    off.add_argument("--engine-block-size", type=_positive(int), default=16,
                     help="KV block size of the simulated engines and the router's index")
    off.add_argument("--index-block-size", type=_positive(int), default=None,
                     help="tokens per prefix-index entry (default: the engine block size, as the live "
                          "router; 512 on Mooncake traces is ~2x faster)")
    off.add_argument("--scrape-interval", type=float, default=1.0,
                     help="virtual seconds between the router's engine-load scrapes (0 = always exact)")
    off.add_argument("--index-capacity", type=_positive(int), default=None,
                     help="prefix-index blocks per replica (default: the replica's KV capacity)")
    off.add_argument("--tracking", choices=("approx", "exact"), default="approx",
                     help="approx: the index holds the router's own records; exact: the engines' KV "
                          "events also add and remove blocks (docs/kv-events.md)")
    off.add_argument("--plot", default=None, metavar="FILE.png", help="hit rate and TTFT CDF per policy")
    return p


def _print_live(s: dict[str, Any]) -> None:
    print(f"requests       {s['ok']:,} ok of {s['requests']:,} in {s['duration_s']:.1f} s "
          f"({s['throughput_rps']:.2f} req/s, {s['output_tokens_per_s']:,.0f} output tok/s)")
    print(f"hit rate       {s['hit_rate']:.3f} of prompt tokens from usage "
          f"({s['cached_tokens']:,} / {s['prompt_tokens']:,})")
    if s.get("engine_hit_rate") is not None:
        print(f"               {s['engine_hit_rate']:.3f} from the engines' prefix-cache counters")
    print(f"TTFT           p50 {s['ttft_p50_s'] * 1000:.1f} ms  p90 {s['ttft_p90_s'] * 1000:.1f} ms  "
          f"p99 {s['ttft_p99_s'] * 1000:.1f} ms")
    print(f"ITL            p50 {s['itl_p50_s'] * 1000:.2f} ms  p99 {s['itl_p99_s'] * 1000:.2f} ms")
    print(f"E2E            p50 {s['e2e_p50_s']:.2f} s  p99 {s['e2e_p99_s']:.2f} s")
    for rep, d in s["per_replica"].items():
        print(f"  replica {rep}: {d['requests']:,} requests, {d['prompt_tokens']:,} prompt tokens, "
              f"{d['cached_tokens']:,} cached")
    print(f"load imbalance {s['load_imbalance']:.2f} (max/mean requests per replica)")
    if s.get("prompt_mode"):
        print(f"prompts        {s['prompt_mode']}")
    if s["errors"]:
        print(f"errors         {s['errors']}")


def run_live(args: argparse.Namespace, reqs: list[TraceRequest]) -> int:
    import aiohttp

    from loadtest.live import LiveOptions, replay_live

    opts = LiveOptions(
        target=args.target, model=args.model, endpoint=args.endpoint, prompt_mode=args.prompt_mode,
        speed=args.speed, max_concurrency=args.max_concurrency, duration_s=args.duration,
        timeout_s=args.timeout, max_output_tokens=args.max_output_tokens,
        replica_header=args.replica_header, engine_metrics=tuple(args.engine_metrics),
        api_key=args.api_key, admin_key=args.admin_key, seed=args.seed, vllm_extensions=not args.no_vllm_extensions)
    opts.validate()
    show = sys.stderr.isatty() if args.progress is None else args.progress
    with ExitStack() as stack:
        out = stack.enter_context(open(args.out, "w", encoding="utf-8")) if args.out else None  # noqa: SIM115
        progress = None
        task = None
        if show:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            progress = stack.enter_context(Progress(
                TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[errors]} errors"), console=Console(stderr=True)))
            task = progress.add_task("replay", total=len(reqs), errors=0)
        errors = 0

        def on_record(rec: dict[str, Any]) -> None:
            nonlocal errors
            if out is not None:
                out.write(json.dumps(rec) + "\n")
            if rec.get("error") or rec.get("status") != 200:
                errors += 1
            if progress is not None and task is not None:
                progress.update(task, advance=1, errors=errors)

        try:
            result = asyncio.run(replay_live(reqs, opts, on_record))
        except KeyboardInterrupt:
            print("kvrouter replay: interrupted" + (f"; records so far in {args.out}" if args.out else ""),
                  file=sys.stderr)
            return 130
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            print(f"kvrouter replay: cannot use {args.target}: {exc}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(result.summary, indent=2))
    else:
        _print_live(result.summary)
    return 0 if result.summary["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.offline == bool(args.target):
        parser.print_usage(sys.stderr)
        print("kvrouter replay: give exactly one of --target URL (live) or --offline", file=sys.stderr)
        return 2
    try:
        reqs = load_trace(args.trace, args.format, args.block_size, args.limit)
    except (OSError, TraceFormatError) as exc:
        print(f"kvrouter replay: {exc}", file=sys.stderr)
        return 2
    if not reqs:
        print("kvrouter replay: the trace has no requests", file=sys.stderr)
        return 2
    try:
        if args.offline:
            from loadtest.offline import run_offline_cli

            return run_offline_cli(args, reqs)
        return run_live(args, reqs)
    except ValueError as exc:
        print(f"kvrouter replay: {exc}", file=sys.stderr)
        return 2
