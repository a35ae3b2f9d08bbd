"""Pure summary statistics shared by ``trace stats``, live replay and offline replay:
percentiles, distributions and load imbalance. No I/O."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence


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
