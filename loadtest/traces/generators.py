"""Seeded synthetic workloads, as ``list[TraceRequest]`` with prefix-chained hash ids.

Each generator takes a ``seed`` and returns the same trace for the same arguments:

- :func:`tenants` — N tenants, each with its own system prompt; tenants are picked with
  Zipf popularity, each request adds a unique user message. Poisson arrivals.
- :func:`multi_turn` — chat sessions whose prompt is the whole history (system prompt,
  earlier user turns and answers) plus the new turn; think time between turns.
- :func:`rag` — a shared system prompt, then k documents drawn from a shared corpus with
  Zipf popularity (prefix reuse only when the same documents come in the same order),
  then the question.
- :func:`agentic` — tool loops: each step appends the model's tool call and the tool's
  result to the context and calls again after a short gap.
- :func:`mixed` — all four merged on one clock.

Ids are interned from ``(parent id, content key)``, so the same id at the same position
always means the same prefix, exactly as in the Mooncake release. Prompts are whole blocks.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable, Hashable
from typing import Any

from loadtest.traces.types import TraceRequest, sort_by_time


class _Ids:
    """Interns (parent id, content key) → a new integer id (prefix-chained ids)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, Hashable], int] = {}

    def chain(self, keys: list[Hashable]) -> list[int]:
        out = []
        parent = -1
        for k in keys:
            parent = self._ids.setdefault((parent, k), len(self._ids))
            out.append(parent)
        return out


def _zipf_cum(n: int, s: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (k ** s) for k in range(1, n + 1)))


def _pick(rng: random.Random, cum: list[float]) -> int:
    return bisect.bisect_left(cum, rng.random() * cum[-1])


def _r(rng: random.Random, span: tuple[int, int]) -> int:
    return rng.randint(span[0], span[1])


def tenants(n_requests: int = 1000, n_tenants: int = 20, zipf_s: float = 1.1, rate: float = 5.0,
            system_blocks: tuple[int, int] = (8, 64), user_blocks: tuple[int, int] = (1, 8),
            output: tuple[int, int] = (32, 256), block_size: int = 16, seed: int = 0) -> list[TraceRequest]:
    """Tenants with shared system prompts, Zipf popularity, Poisson arrivals."""
    rng = random.Random(seed)
    ids = _Ids()
    sys_len = [_r(rng, system_blocks) for _ in range(n_tenants)]
    cum = _zipf_cum(n_tenants, zipf_s)
    t = 0.0
    out = []
    for i in range(n_requests):
        t += rng.expovariate(rate)
        k = _pick(rng, cum)
        keys: list[Hashable] = [("sys", k, j) for j in range(sys_len[k])]
        keys += [("user", i, j) for j in range(_r(rng, user_blocks))]
        h = ids.chain(keys)
        out.append(TraceRequest(t, len(h) * block_size, _r(rng, output), h, block_size,
                                tenant=f"tenant-{k}"))
    return sort_by_time(out)


def multi_turn(n_sessions: int = 100, turns: tuple[int, int] = (2, 8), rate: float = 1.0,
               think_time_s: tuple[float, float] = (5.0, 60.0), system_blocks: tuple[int, int] = (8, 32),
               turn_blocks: tuple[int, int] = (1, 16), output: tuple[int, int] = (32, 512),
               block_size: int = 16, seed: int = 0) -> list[TraceRequest]:
    """Chat sessions with growing history (the answer of turn k is in the prompt of k+1)."""
    rng = random.Random(seed)
    ids = _Ids()
    out = []
    start = 0.0
    for s in range(n_sessions):
        start += rng.expovariate(rate)
        t = start
        keys: list[Hashable] = [("sys", s, j) for j in range(_r(rng, system_blocks))]
        for turn in range(_r(rng, turns)):
            keys += [("user", s, turn, j) for j in range(_r(rng, turn_blocks))]
            h = ids.chain(keys)
            n_out = _r(rng, output)
            out.append(TraceRequest(t, len(h) * block_size, n_out, h, block_size, session_id=f"s{s}"))
            keys += [("answer", s, turn, j) for j in range(n_out // block_size)]
            t += rng.uniform(*think_time_s)
    return sort_by_time(out)


def rag(n_requests: int = 1000, n_docs: int = 200, docs_per_request: tuple[int, int] = (1, 4),
        doc_blocks: tuple[int, int] = (8, 32), zipf_s: float = 1.0, rate: float = 5.0,
        system_blocks: int = 8, question_blocks: tuple[int, int] = (1, 4),
        output: tuple[int, int] = (32, 256), block_size: int = 16, seed: int = 0) -> list[TraceRequest]:
    """Retrieval-augmented prompts over a shared corpus with Zipf document popularity."""
    rng = random.Random(seed)
    ids = _Ids()
    lens = [_r(rng, doc_blocks) for _ in range(n_docs)]
    cum = _zipf_cum(n_docs, zipf_s)
    t = 0.0
    out = []
    for i in range(n_requests):
        t += rng.expovariate(rate)
        keys: list[Hashable] = [("sys", j) for j in range(system_blocks)]
        docs: list[int] = []
        want = min(_r(rng, docs_per_request), n_docs)
        while len(docs) < want:
            d = _pick(rng, cum)
            if d not in docs:
                docs.append(d)
        for d in docs:
            keys += [("doc", d, j) for j in range(lens[d])]
        keys += [("q", i, j) for j in range(_r(rng, question_blocks))]
        h = ids.chain(keys)
        out.append(TraceRequest(t, len(h) * block_size, _r(rng, output), h, block_size))
    return sort_by_time(out)


def agentic(n_agents: int = 20, steps: tuple[int, int] = (5, 20), rate: float = 0.5,
            step_gap_s: tuple[float, float] = (0.5, 3.0), system_blocks: tuple[int, int] = (32, 128),
            task_blocks: tuple[int, int] = (2, 8), tool_blocks: tuple[int, int] = (1, 6),
            output: tuple[int, int] = (16, 128), shared_tools: bool = True,
            block_size: int = 16, seed: int = 0) -> list[TraceRequest]:
    """Agentic tool loops: the context grows by a tool call and its result per step."""
    rng = random.Random(seed)
    ids = _Ids()
    tools_len = _r(rng, system_blocks)
    out = []
    start = 0.0
    for a in range(n_agents):
        start += rng.expovariate(rate)
        t = start
        sys_key: Hashable = "tools" if shared_tools else ("tools", a)
        keys: list[Hashable] = [(sys_key, j) for j in range(tools_len)]
        keys += [("task", a, j) for j in range(_r(rng, task_blocks))]
        for step in range(_r(rng, steps)):
            h = ids.chain(keys)
            n_out = _r(rng, output)
            out.append(TraceRequest(t, len(h) * block_size, n_out, h, block_size, session_id=f"agent{a}"))
            keys += [("call", a, step, j) for j in range(max(1, n_out // block_size))]
            keys += [("result", a, step, j) for j in range(_r(rng, tool_blocks))]
            t += rng.uniform(*step_gap_s)
    return sort_by_time(out)


def mixed(scale: int = 1, block_size: int = 16, seed: int = 0) -> list[TraceRequest]:
    """The four workloads on one clock (``scale`` multiplies their sizes)."""
    parts = [
        tenants(n_requests=300 * scale, block_size=block_size, seed=seed),
        multi_turn(n_sessions=40 * scale, block_size=block_size, seed=seed + 1),
        rag(n_requests=300 * scale, block_size=block_size, seed=seed + 2),
        agentic(n_agents=10 * scale, block_size=block_size, seed=seed + 3),
    ]
    # Offset each workload's ids so they never collide.
    out = []
    offset = 0
    for kind, part in zip(("tenants", "chat", "rag", "agent"), parts, strict=True):
        top = 0
        for r in part:
            r.hash_ids = [h + offset for h in r.hash_ids]
            r.tenant = r.tenant or kind
            top = max([top, *r.hash_ids])
        offset = top + 1
        out.extend(part)
    return sort_by_time(out)


GENERATORS: dict[str, Callable[..., list[TraceRequest]]] = {
    "tenants": tenants,
    "multi_turn": multi_turn,
    "rag": rag,
    "agentic": agentic,
    "mixed": mixed,
}


def generate(kind: str, **kwargs: Any) -> list[TraceRequest]:
    """Run the generator named ``kind`` with keyword arguments."""
    try:
        fn = GENERATORS[kind]
    except KeyError:
        raise ValueError(f"unknown generator {kind!r}; known: {', '.join(GENERATORS)}") from None
    return fn(**kwargs)
