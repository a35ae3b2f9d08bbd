"""The pure parts of ``make chaos`` (:mod:`loadtest.chaos`): what class each request ends in,
the summary and its table, the trace scaled to the run's size, and the RSS/fd flatness check
of ``--soak``. No I/O; :mod:`loadtest.chaos` re-exports these names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import orjson

from loadtest.traces.types import TraceRequest


@dataclass(slots=True)
class Outcome:
    i: int
    router: int
    t_start: float
    t_end: float = 0.0
    kind: str = ""  # completed | failed | lost | hung
    detail: str = ""
    rerouted: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class Fault:
    name: str
    t_start: float
    t_end: float = 0.0  # recovered (restarted and back in rotation)


def classify_stream(status: int, content_type: str, body: bytes) -> tuple[str, str, dict[str, Any] | None]:
    """(kind, detail, usage) of one finished HTTP exchange (pure; see the module docstring)."""
    if status != 200:
        try:
            err = orjson.loads(body).get("error")
        except (orjson.JSONDecodeError, AttributeError):
            err = None
        if isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err) and status >= 400:
            return "failed", f"http {status}: {err.get('code')}", None
        return "lost", f"http {status} without an OpenAI error body: {body[:120]!r}", None
    if "text/event-stream" not in content_type:
        return "lost", f"200 with content type {content_type!r}", None
    usage = None
    error = None
    done = False
    for event in body.split(b"\n\n"):
        line = event.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            continue
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return "lost", "unparseable stream event", None
        if isinstance(chunk, dict):
            if isinstance(chunk.get("error"), dict):
                error = chunk["error"]
            if chunk.get("usage"):
                usage = chunk["usage"]
    if error is not None:
        return "failed", f"stream error event: {error.get('code')}", usage
    if not done:
        return "lost", "stream truncated without an error event", usage
    return "completed", "", usage


def hit_rate(outs: list[Outcome], lo: float, hi: float) -> float | None:
    sel = [o for o in outs if lo <= o.t_start < hi and o.kind == "completed" and o.prompt_tokens]
    p = sum(o.prompt_tokens for o in sel)
    return sum(o.cached_tokens for o in sel) / p if p else None


def summarize(outs: list[Outcome], faults: list[Fault]) -> dict[str, Any]:
    kinds = {k: sum(1 for o in outs if o.kind == k) for k in ("completed", "failed", "lost", "hung")}
    rows = []
    for f in faults:
        end = f.t_end or f.t_start
        w = max(end - f.t_start, 5.0)
        during = [o for o in outs if f.t_start <= o.t_start < end]
        rows.append({
            "fault": f.name, "window_s": round(end - f.t_start, 1), "sent": len(during),
            "failed": sum(1 for o in outs if o.kind == "failed" and f.t_start <= o.t_end < end + 1.0),
            "lost": sum(1 for o in during if o.kind == "lost"),
            "hung": sum(1 for o in during if o.kind == "hung"),
            "hit_before": hit_rate(outs, f.t_start - w, f.t_start),
            "hit_during": hit_rate(outs, f.t_start, end),
            "hit_after": hit_rate(outs, end, end + w),
        })
    def in_fault(o: Outcome) -> bool:
        return any(f.t_start <= o.t_end < (f.t_end or f.t_start) + 1.0 for f in faults)

    details: dict[str, int] = {}
    for o in outs:
        if o.kind != "completed":
            key = f"{o.kind}: {o.detail}"
            details[key] = details.get(key, 0) + 1
    return {"sent": len(outs), **kinds, "rerouted": sum(1 for o in outs if o.rerouted),
            "failed_outside_faults": sum(1 for o in outs if o.kind == "failed" and not in_fault(o)),
            "hit_rate": hit_rate(outs, -math.inf, math.inf), "faults": rows, "details": details}


def verdict(s: dict[str, Any], soak: bool = False) -> list[str]:
    """Why the run failed (empty: it passed). A lost or hung request, a request that failed
    outside every fault window (a healthy fleet fails none: a bug), or, with ``--soak``,
    RSS/fds that grew."""
    bad = [f"{s[k]} {k} request(s)" for k in ("lost", "hung") if s[k]]
    if s["failed_outside_faults"]:
        bad.append(f"{s['failed_outside_faults']} request(s) failed outside the fault windows")
    if soak and not s.get("soak", {}).get("ok", True):
        bad.append(f"soak: resources grew ({s['soak'].get('detail', '')})")
    return bad


def _pct(v: float | None) -> str:
    return "   -  " if v is None else f"{v * 100:5.1f}%"


def render(s: dict[str, Any]) -> str:
    out = [f"requests sent          {s['sent']:>6}",
           f"completed              {s['completed']:>6}",
           f"failed (OpenAI error)  {s['failed']:>6}   ({s['failed_outside_faults']} outside the fault windows)",
           f"lost                   {s['lost']:>6}",
           f"hung                   {s['hung']:>6}",
           f"rerouted by the client {s['rerouted']:>6}   (connection refused by a stopped router; no byte sent)",
           f"hit rate (all)         {_pct(s['hit_rate'])}   (infinite-cache ideal of the requests sent: "
           f"{_pct(s.get('ideal_hit_rate'))})",
           "",
           f"{'fault':<34} {'window':>7} {'sent':>5} {'failed':>6} {'lost':>4} {'hung':>4}   "
           f"{'hit before':>10} {'during':>7} {'after':>7}"]
    for r in s["faults"]:
        out.append(f"{r['fault']:<34} {r['window_s']:>6.1f}s {r['sent']:>5} {r['failed']:>6} {r['lost']:>4} "
                   f"{r['hung']:>4}   {_pct(r['hit_before']):>10} {_pct(r['hit_during']):>7} "
                   f"{_pct(r['hit_after']):>7}")
    if s["details"]:
        out.append("")
        out.extend(f"  {n:>5} x {k}" for k, n in sorted(s["details"].items(), key=lambda kv: -kv[1]))
    return "\n".join(out)


def scaled_requests(trace: list[TraceRequest], n: int, block_tokens: int,
                    fresh_passes: bool = False) -> list[TraceRequest]:
    """``n`` requests: the trace in passes (repeating its prompts, or each pass with its own
    ids when ``fresh_passes``), prompts scaled to ``block_tokens`` per trace block."""
    out: list[TraceRequest] = []
    span = max((h for r in trace for h in r.hash_ids), default=0) + 1 if fresh_passes else 0
    k = 0
    while len(out) < n:
        for r in trace:
            if len(out) >= n:
                break
            f = block_tokens / r.block_size
            length = max(1, min(round(r.input_length * f), len(r.hash_ids) * block_tokens or 1))
            out.append(replace(r, input_length=length, block_size=block_tokens, body=None,
                               hash_ids=[h + k * span for h in r.hash_ids]))
        k += 1
    return out


def flat(samples: list[tuple[float, int, int]], rss_slack: float = 0.25, fd_slack: int = 32) -> tuple[bool, str]:
    """Did RSS and fds stay flat? Compares the last third of the samples with the second
    third (the first third is warm-up)."""
    if len(samples) < 6:
        return True, "too few samples to judge"
    n = len(samples) // 3
    mid, last = samples[n: 2 * n], samples[-n:]
    rss_mid = max(s[1] for s in mid)
    rss_last = max(s[1] for s in last)
    fd_mid = max(s[2] for s in mid)
    fd_last = max(s[2] for s in last)
    ok = rss_last <= rss_mid * (1 + rss_slack) and fd_last <= fd_mid + fd_slack
    return ok, (f"RSS {rss_mid / 2**20:.1f} -> {rss_last / 2**20:.1f} MiB, "
                f"fds {fd_mid} -> {fd_last} (mid third -> last third)")
