"""Per-engine knowledge the router needs: vLLM / SGLang load metric names, and a small,
fast Prometheus text-format reader for just those metrics (also used, on every metric, by
the load tools: :func:`parse_prometheus`, :func:`engine_hit_delta`).

The router scrapes each replica's ``/metrics`` about once a second. Parsing the whole
exposition (hundreds of histogram buckets) with a general parser is wasteful; this reader
looks only at sample lines whose metric name is one the router uses and ignores everything
else, so unknown or malformed lines never fail a scrape. Pure: text in, numbers out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

# engine -> role -> metric name (gauges; values summed over label sets, e.g. dp ranks)
VLLM_METRICS = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_usage": "vllm:kv_cache_usage_perc",
}
VLLM_LEGACY_KV = "vllm:gpu_cache_usage_perc"  # removed in newer vLLM, still read when present
VLLM_CACHE_INFO = "vllm:cache_config_info"  # labels carry block_size and num_gpu_blocks
SGLANG_METRICS = {
    "running": "sglang:num_running_reqs",
    "waiting": "sglang:num_queue_reqs",
    "kv_usage": "sglang:token_usage",
}
SGLANG_MAX_TOKENS = "sglang:max_total_num_tokens"

_ROLE_OF: dict[str, str] = {name: role for metrics in (VLLM_METRICS, SGLANG_METRICS)
                            for role, name in metrics.items()} | {VLLM_LEGACY_KV: "kv_usage"}
_WANTED = (*_ROLE_OF, VLLM_CACHE_INFO, SGLANG_MAX_TOKENS)


@dataclass(slots=True)
class EngineLoad:
    """The load figures of one replica. ``engine`` is ``vllm``, ``sglang`` or ``unknown``
    (no known metric found). ``kv_usage`` is in [0, 1] (mean over label sets, e.g. DP
    ranks); ``running``/``waiting`` are summed. ``num_blocks``/``block_size`` come from
    ``vllm:cache_config_info`` when the engine exports it."""

    engine: str = "unknown"
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    num_blocks: int | None = None
    block_size: int | None = None
    max_total_tokens: int | None = None


def _labels(s: str) -> dict[str, str]:
    """Parse ``a="x",b="y"`` (escapes \\\\, \\" and \\n honoured)."""
    out: dict[str, str] = {}
    i, n = 0, len(s)
    while i < n:
        eq = s.find("=", i)
        if eq < 0:
            break
        key = s[i:eq].strip().lstrip(",").strip()
        j = eq + 1
        if j >= n or s[j] != '"':
            break
        j += 1
        buf = []
        while j < n and s[j] != '"':
            if s[j] == "\\" and j + 1 < n:
                nxt = s[j + 1]
                buf.append("\n" if nxt == "n" else nxt)
                j += 2
            else:
                buf.append(s[j])
                j += 1
        out[key] = "".join(buf)
        i = j + 1
    return out


def parse_samples(text: str, names: tuple[str, ...] | None = _WANTED) -> list[tuple[str, dict[str, str], float]]:
    """Samples ``(name, labels, value)`` of the metrics in ``names`` (every metric when
    ``names`` is None); other lines, comments and malformed or NaN samples skipped."""
    out: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        if not line or line[0] == "#" or (names is not None and not line.startswith(names)):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            close = line.rfind("}")
            if close < brace:
                continue
            name, labels, rest = line[:brace], _labels(line[brace + 1 : close]), line[close + 1 :]
        else:
            if space == -1:
                continue
            name, labels, rest = line[:space], {}, line[space:]
        if not name or (names is not None and name not in names):
            continue
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        out.append((name, labels, value))
    return out


def parse_load(text: str) -> EngineLoad:
    """The load of a vLLM or SGLang replica from its ``/metrics`` text."""
    load = EngineLoad()
    kv: list[float] = []
    legacy_kv: list[float] = []
    for name, labels, value in parse_samples(text):
        if name == VLLM_CACHE_INFO:
            try:
                load.num_blocks = int(float(labels.get("num_gpu_blocks", "")))
            except ValueError:
                pass
            try:
                load.block_size = int(float(labels.get("block_size", "")))
            except ValueError:
                pass
            continue
        if name == SGLANG_MAX_TOKENS:
            load.max_total_tokens = int(value)
            load.engine = "sglang"
            continue
        load.engine = "vllm" if name.startswith("vllm:") else "sglang"
        role = _ROLE_OF[name]
        if role == "running":
            load.running += value
        elif role == "waiting":
            load.waiting += value
        elif name == VLLM_LEGACY_KV:
            legacy_kv.append(value)
        else:
            kv.append(value)
    vals = kv or legacy_kv
    if vals:
        load.kv_usage = min(1.0, max(0.0, sum(vals) / len(vals)))
    return load


def parse_prometheus(text: str) -> dict[str, float]:
    """Metric name → value summed over its label sets, for every metric in a ``/metrics``
    text (comments and bad lines skipped)."""
    out: dict[str, float] = {}
    for name, _, value in parse_samples(text, None):
        out[name] = out.get(name, 0.0) + value
    return out


def _counter(m: Mapping[str, float], name: str) -> float | None:
    for key in (name + "_total", name):
        if key in m:
            return m[key]
    return None


def engine_hit_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float] | None:
    """Prefix-cache queries and hits (tokens) between two scrapes (:func:`parse_prometheus`)
    of one vLLM-style engine, or None when the engine exposes no such counters."""
    qb, qa = _counter(before, "vllm:prefix_cache_queries"), _counter(after, "vllm:prefix_cache_queries")
    hb, ha = _counter(before, "vllm:prefix_cache_hits"), _counter(after, "vllm:prefix_cache_hits")
    if qa is None or ha is None:
        return None
    return {"queries": qa - (qb or 0.0), "hits": ha - (hb or 0.0)}
