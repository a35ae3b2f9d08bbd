"""The simulated engine's ``/metrics``: vLLM's metric names, types and labels, in simulated time.

:class:`SimMetrics` observes each :class:`~backends.sim.engine.StepResult` (O(1) per step plus
O(1) per first token / finished request) and renders the Prometheus text exposition
together with the engine's gauges and counters. Every duration is in the engine's
(simulated) seconds, so the figures do not depend on ``--time-scale``.

Pure: no clock, no I/O; a small fixed-bucket histogram instead of a metrics library so an
observation costs a ``bisect``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from backends.sim.engine import EngineModel, StepResult

# vLLM's bucket boundaries (seconds / tokens)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000, 200000)


class Histogram:
    """Fixed buckets; ``observe(value, count)`` adds ``count`` observations of ``value``."""

    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, count: int = 1) -> None:
        if count <= 0:
            return
        self.counts[bisect_left(self.buckets, value)] += count
        self.sum += value * count
        self.count += count

    def render(self, name: str, labels: str, out: list[str]) -> None:
        acc = 0
        for b, c in zip(self.buckets, self.counts, strict=False):
            acc += c
            out.append(f'{name}_bucket{{{labels},le="{_num(b)}"}} {acc}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_count{{{labels}}} {self.count}")
        out.append(f"{name}_sum{{{labels}}} {_num(self.sum)}")


def _num(v: float) -> str:
    return repr(float(v))


def _esc(v: object) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "itl": ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    "e2e": ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            LATENCY_BUCKETS),
    "queue": ("vllm:request_queue_time_seconds",
              "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS),
    "decode": ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase.",
               LATENCY_BUCKETS),
    "prefill": ("vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.", LATENCY_BUCKETS),
    "prompt": ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS),
    "gen": ("vllm:request_generation_tokens", "Number of generation tokens processed.", TOKEN_BUCKETS),
}

COUNTERS = (
    ("vllm:prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "generation_tokens", "Number of generation tokens processed."),
    ("vllm:prefix_cache_queries", "prefix_cache_queries", "Prefix cache queries, in terms of tokens."),
    ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in terms of tokens."),
    ("vllm:num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
    ("vllm:spec_decode_num_drafts", "spec_drafts", "Number of spec decoding drafts."),
    ("vllm:spec_decode_num_draft_tokens", "spec_draft_tokens", "Number of draft tokens."),
    ("vllm:spec_decode_num_accepted_tokens", "spec_accepted_tokens", "Number of accepted tokens."),
)


class SimMetrics:
    """Histograms fed from step results; renders the whole ``/metrics`` page."""

    def __init__(self, model_name: str, cache_info: dict[str, object]) -> None:
        self.labels = f'model_name="{_esc(model_name)}",engine="0"'
        self.cache_info = dict(cache_info)
        self.h = {key: Histogram(spec[2]) for key, spec in HISTOGRAMS.items()}

    def observe(self, res: StepResult) -> None:
        h = self.h
        later = len(res.tokens) - len(res.first)
        if later > 0 and res.steps:
            h["itl"].observe(res.duration / res.steps, later * res.steps)
        for r in res.first:
            if r.first_token_time is not None:
                h["ttft"].observe(r.first_token_time - r.arrival)
                sched = r.arrival if r.scheduled_time is None else r.scheduled_time
                h["queue"].observe(sched - r.arrival)
                h["prefill"].observe(r.first_token_time - sched)
        for r in res.finished:
            self.observe_finished(r)

    def observe_finished(self, r) -> None:  # noqa: ANN001 - engine Request
        h = self.h
        if r.finish_time is None:
            return
        h["e2e"].observe(r.finish_time - r.arrival)
        if r.first_token_time is not None:
            h["decode"].observe(r.finish_time - r.first_token_time)
        h["prompt"].observe(r.prompt_len)
        h["gen"].observe(r.num_output)

    def render(self, eng: EngineModel) -> str:
        lab = self.labels
        out: list[str] = []
        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", eng.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", eng.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", eng.kv_usage),
        )
        for name, text, value in gauges:
            out += [f"# HELP {name} {text}", f"# TYPE {name} gauge", f"{name}{{{lab}}} {_num(value)}"]
        info = ",".join(f'{k}="{_esc(v)}"' for k, v in self.cache_info.items())
        out += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                "# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{info},engine=\"0\"}} 1.0"]
        st = eng.stats
        for name, attr, text in COUNTERS:
            out += [f"# HELP {name} {text}", f"# TYPE {name} counter",
                    f"{name}_total{{{lab}}} {_num(getattr(st, attr))}"]
        out += ["# HELP vllm:request_success Count of successfully processed requests.",
                "# TYPE vllm:request_success counter"]
        for reason in ("stop", "length", "abort"):
            out.append(f'vllm:request_success_total{{{lab},finished_reason="{reason}"}} '
                       f"{_num(st.finished.get(reason, 0))}")
        for key, (name, text, _) in HISTOGRAMS.items():
            out += [f"# HELP {name} {text}", f"# TYPE {name} histogram"]
            self.h[key].render(name, lab, out)
        out.append("")
        return "\n".join(out)
