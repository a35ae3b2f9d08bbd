"""The simulated engine's data: the cost-model protocol, block hashers and the output tape,
:class:`EngineConfig`, :class:`Request` (with its in-engine state), :class:`StepResult` and
:class:`EngineStats`. Pure. :mod:`backends.sim.engine` (the scheduler, ``EngineModel``)
re-exports every name here.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.core.hashing import block_hashes, seed_hash


class CostModel(Protocol):
    """What one step costs (``backends.planner.Roofline`` satisfies this)."""

    def step_time_s(self, prefill_tokens: int, decode_seqs: int, kv_tokens_read: int) -> float: ...

    def spec_step_time_s(self, decode_seqs: int, kv_tokens: int) -> float: ...


BlockHasher = Callable[..., list[int]]
"""``hasher(tokens, block_size, *, parent, model, lora, cache_salt) -> hashes`` of every
full block of ``tokens``, chained after ``parent`` (``None`` = first block of a prompt)."""


def xxh_block_hasher(tokens: Sequence[int], block_size: int, *, parent: int | None, model: str,
                     lora: str | None = None, cache_salt: str | None = None) -> list[int]:
    """The default: the router's own chain (``router.core.hashing``), seeded by
    ``seed_hash(model, lora, cache_salt)``, so router and engine hashes agree."""
    seed = seed_hash(model, lora, cache_salt) if parent is None else parent
    return block_hashes(tokens, block_size, seed)


def make_tape(seed: int, char_ids: Callable[[str], int | None], length: int = 8192) -> tuple[int, ...]:
    """A deterministic stream of output token ids spelling lowercase words and spaces.
    ``char_ids`` maps one character to its single token id (None when it has none)."""
    rng = random.Random(seed)
    letters = [c for c in "etaoinshrdlucmfwypvbgkqjxz" if char_ids(c) is not None]
    space = char_ids(" ")
    if not letters:
        raise ValueError("the tokenizer has no single-token letters")
    out: list[int] = []
    while len(out) < length:
        for _ in range(rng.randint(1, 9)):
            out.append(char_ids(rng.choice(letters[:20] if rng.random() < 0.9 else letters)))  # type: ignore[arg-type]
        if space is not None:
            out.append(space)
    return tuple(out[:length])


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    spec_tokens: int = 0
    spec_acceptance: float = 0.0
    model: str = "sim-model"
    seed: int = 0
    record_kv_events: bool = False
    hasher: BlockHasher = xxh_block_hasher
    output_tape: tuple[int, ...] | None = None  # default: ASCII words in byte-level ids


@dataclass(slots=True, eq=False)
class Request:
    """One generation request and its state inside the engine."""

    req_id: str
    prompt_len: int
    max_tokens: int
    block_hashes: list[int] | None = None
    prompt_ids: list[int] | None = None
    lora: str | None = None
    cache_salt: str | None = None
    seed: int | None = None
    tag: Any = None  # free for the driver (the HTTP server keeps its stream handle here)
    # -- state, set by the engine --
    arrival: float = 0.0
    num_computed: int = 0
    num_output: int = 0
    output_ids: list[int] | None = None
    blocks: list[int] = field(default_factory=list)
    num_stored: int = 0  # leading blocks registered in the prefix cache by/for this request
    in_decode: bool = False
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not yet admitted)
    num_preemptions: int = 0
    scheduled_time: float | None = None  # first admitted into the batch
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    _tape_off: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cached_tokens(self) -> int:
        return max(self.num_cached_tokens, 0)


@dataclass(slots=True)
class StepResult:
    """What one call to ``step``/``fast_forward`` did. ``tokens`` lists each request that got
    output tokens with how many (its ids, when materialized, are the tail of
    ``req.output_ids``); ``first`` the requests whose first token this was."""

    start: float
    duration: float
    steps: int = 0
    prefill_tokens: int = 0
    decode_seqs: int = 0
    tokens: list[tuple[Request, int]] = field(default_factory=list)
    first: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass(slots=True)
class EngineStats:
    """Monotonic counters (vLLM's metric names in comments)."""

    prompt_tokens: int = 0  # vllm:prompt_tokens
    generation_tokens: int = 0  # vllm:generation_tokens
    prefix_cache_queries: int = 0  # vllm:prefix_cache_queries (tokens)
    prefix_cache_hits: int = 0  # vllm:prefix_cache_hits (tokens)
    num_preemptions: int = 0  # vllm:num_preemptions
    spec_drafts: int = 0  # vllm:spec_decode_num_drafts
    spec_draft_tokens: int = 0  # vllm:spec_decode_num_draft_tokens
    spec_accepted_tokens: int = 0  # vllm:spec_decode_num_accepted_tokens
    steps: int = 0
    busy_time: float = 0.0
    finished: dict[str, int] = field(default_factory=dict)  # vllm:request_success{finished_reason}
