"""Pure summary statistics shared by ``trace stats``, live replay and offline replay:
percentiles, distributions and load imbalance. No I/O."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

# engine /metrics reading lives with the engine knowledge; re-exported for existing imports
from backends.engines import engine_hit_delta, parse_prometheus  # noqa: F401


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def distribution(values: Iterable[float]) -> dict[str, float]:
    """mean, p50, p90, p99, max of ``values`` (zeros when empty)."""
    xs = sorted(values)
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    return {"mean": sum(xs) / len(xs), "p50": percentile(xs, 50), "p90": percentile(xs, 90),
            "p99": percentile(xs, 99), "max": float(xs[-1])}


def load_imbalance(per_replica: Mapping[str, int], replicas: Sequence[str] | None = None) -> float:
    """max / mean requests per replica (replicas listed but idle count as 0); 1.0 is even."""
    ids = list(replicas) if replicas is not None else list(per_replica)
    if not ids:
        return 0.0
    counts = [per_replica.get(r, 0) for r in ids]
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else 0.0


# -- replay records -------------------------------------------------------------------------

def summarize_records(records: Sequence[Mapping[str, object]], wall_s: float) -> dict[str, object]:
    """The summary of a replay from its per-request records (the dicts written as JSONL):
    hit rate from usage (token-weighted), TTFT/ITL/E2E percentiles, throughput, requests
    and tokens per replica, errors by status."""
    ok = [r for r in records if r.get("status") == 200 and not r.get("error")]
    errors: dict[str, int] = {}
    for r in records:
        if r not in ok:
            key = str(r.get("status") or r.get("error") or "error")
            errors[key] = errors.get(key, 0) + 1
    prompt = sum(int(r.get("prompt_tokens") or 0) for r in ok)
    cached = sum(int(r.get("cached_tokens") or 0) for r in ok)
    out_tok = sum(int(r.get("completion_tokens") or 0) for r in ok)
    ttft = [float(r["ttft_s"]) for r in ok if r.get("ttft_s") is not None]  # type: ignore[arg-type]
    itl = [float(r["itl_mean_s"]) for r in ok if r.get("itl_mean_s") is not None]  # type: ignore[arg-type]
    e2e = [float(r["e2e_s"]) for r in ok if r.get("e2e_s") is not None]  # type: ignore[arg-type]
    per: dict[str, dict[str, int]] = {}
    for r in ok:
        rep = str(r.get("replica") or "?")
        d = per.setdefault(rep, {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
        d["requests"] += 1
        d["prompt_tokens"] += int(r.get("prompt_tokens") or 0)  # type: ignore[call-overload]
        d["cached_tokens"] += int(r.get("cached_tokens") or 0)  # type: ignore[call-overload]
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": errors,
        "duration_s": wall_s,
        "throughput_rps": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_tokens_per_s": out_tok / wall_s if wall_s > 0 else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "per_replica": dict(sorted(per.items())),
        "load_imbalance": load_imbalance({k: v["requests"] for k, v in per.items()}),
    }
