"""The simulated engine: a pure, discrete-event model of one vLLM-like GPU engine.

Pure: time is passed in, nothing reads a clock, no I/O, randomness from a seeded
``random.Random``. The data types (``EngineConfig``, ``Request``, ``StepResult``, ...) are
in :mod:`backends.sim.engine_types` and re-exported here. The HTTP server (``backends.sim.server``) drives it in real time; the
offline cluster simulator drives the very same class in virtual time.

API::

    eng = EngineModel(config: EngineConfig, cost: CostModel)
    eng.submit(req: Request, now: float) -> None       # joins the waiting queue
    eng.cancel(req_id: str, now: float) -> bool        # frees its blocks; False if unknown
    eng.step(now: float) -> StepResult                 # one continuous-batching step (starts at
                                                       # max(now, previous end), never before a
                                                       # request it admits has arrived)
    eng.fast_forward(now, until, max_steps) -> StepResult   # several decode-only steps at once
    eng.has_work() -> bool
    eng.num_running, eng.num_waiting, eng.kv_usage, eng.stats (EngineStats counters)
    eng.kv (the KVCache: drain_kv_events(), cached_hashes(), reset via reset_prefix_cache())

A :class:`Request` carries either the prompt's token ids (``prompt_ids``; block hashes are
then computed by ``config.hasher`` and generated tokens are materialized, hashed and
cached as vLLM does) or only ``prompt_len`` plus precomputed ``block_hashes`` (cheap: what
the offline simulator uses; no output ids). A step starting at ``now`` (or when the
previous step ends, whichever is later) lasts ``StepResult.duration``; its tokens exist at
``StepResult.end``. Request timestamps (``first_token_time``, ``finish_time``) are in the
caller's clock.

Scheduling follows vLLM v1: running requests first (decode 1 token, or 1 + k with
speculative decoding; unfinished prefills continue in chunks), then waiting requests FIFO
while the token budget (``max_num_batched_tokens``) and ``max_num_seqs`` allow. A prompt
is matched against the prefix cache when admitted (whole blocks, at most
``(len - 1) // block_size`` blocks so the last token is always computed). When blocks
run out a running request is preempted from the back of the queue and recomputed later.
Step duration comes from the cost model (the planner's roofline): prefill compute over
the uncached tokens scheduled, decode memory-bound over weights + KV read.
"""

from __future__ import annotations

import random
from collections import deque

from backends.sim.engine_types import (  # noqa: F401  (re-exported: the engine's data types)
    BlockHasher,
    CostModel,
    EngineConfig,
    EngineStats,
    Request,
    StepResult,
    make_tape,
    xxh_block_hasher,
)
from backends.sim.kvcache import KVCache, KVCacheEvent


def _byte_id(c: str) -> int | None:
    b = c.encode()
    return b[0] if len(b) == 1 else None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class EngineModel:
    """One simulated engine. See the module docstring for the API."""

    def __init__(self, config: EngineConfig, cost: CostModel) -> None:
        if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if config.spec_tokens < 0 or not 0.0 <= config.spec_acceptance < 1.0:
            raise ValueError("spec_tokens must be >= 0 and spec_acceptance in [0, 1)")
        self.config = config
        self.cost = cost
        self.kv = KVCache(config.num_blocks, config.block_size,
                          enable_prefix_caching=config.enable_prefix_caching,
                          record_events=config.record_kv_events)
        self.stats = EngineStats()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.busy_until = float("-inf")
        self._rng = random.Random(config.seed)
        self._tape = config.output_tape or make_tape(config.seed, _byte_id)

    # -- load --------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.kv.usage()

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def drain_kv_events(self) -> list[KVCacheEvent]:
        return self.kv.drain_events()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset()

    # -- requests ----------------------------------------------------------------------------
    def submit(self, req: Request, now: float) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"duplicate request id {req.req_id!r}")
        if req.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        limit = self.config.max_model_len
        if req.prompt_len < 1 or req.prompt_len >= limit:
            raise ValueError(f"prompt of {req.prompt_len} tokens does not fit max_model_len {limit}")
        req.max_tokens = min(req.max_tokens, limit - req.prompt_len)
        req.arrival = now
        if req.prompt_ids is not None:
            req.output_ids = []
            s = self.config.seed if req.seed is None else req.seed
            key = req.prompt_ids[-64:] if req.prompt_ids else [0]
            req._tape_off = (hash((s, tuple(key))) & 0x7FFFFFFF) % len(self._tape)
        elif req.block_hashes is None:
            req.block_hashes = []
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def cancel(self, req_id: str, now: float) -> bool:
        req = self.requests.pop(req_id, None)
        if req is None:
            return False
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self._free(req)
        req.finish_reason = "abort"
        req.finish_time = now
        self.stats.finished["abort"] = self.stats.finished.get("abort", 0) + 1
        return True

    # -- internals ---------------------------------------------------------------------------
    def _free(self, r: Request) -> None:
        if r.blocks:
            self.kv.release(r.blocks)
            r.blocks = []

    def _preempt(self, r: Request) -> None:
        self._free(r)
        r.num_computed = 0
        r.num_stored = 0
        r.in_decode = False
        r.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(r)

    def _token_slice(self, r: Request, a: int, b: int) -> list[int]:
        p = r.prompt_ids or []
        n = r.prompt_len
        out = r.output_ids or []
        if b <= n:
            return p[a:b]
        if a >= n:
            return out[a - n:b - n]
        return p[a:] + out[:b - n]

    def _hashes(self, r: Request, nblocks: int) -> list[int]:
        """The request's block hashes, extended (when its ids are known) to ``nblocks``."""
        hs = r.block_hashes
        if hs is None:
            hs = r.block_hashes = []
        if len(hs) < nblocks and r.prompt_ids is not None:
            bs = self.config.block_size
            a, b = len(hs) * bs, nblocks * bs
            hs.extend(self.config.hasher(self._token_slice(r, a, b), bs, parent=hs[-1] if hs else None,
                                         model=self.config.model, lora=r.lora, cache_salt=r.cache_salt))
        return hs

    def _store(self, r: Request) -> None:
        if not self.kv.enable_prefix_caching:
            return
        bs = self.config.block_size
        full = min(r.num_computed // bs, len(r.blocks))
        if full <= r.num_stored:
            return
        hs = self._hashes(r, full)
        upto = min(full, len(hs))
        if upto <= r.num_stored:
            return
        a = r.num_stored
        toks = self._token_slice(r, a * bs, upto * bs) if (self.kv.record_events and r.prompt_ids is not None) else ()
        self.kv.store(r.blocks[a:upto], hs[a:upto], hs[a - 1] if a else None, toks, r.lora, r.cache_salt)
        r.num_stored = upto

    def _emit(self, r: Request, n: int, end: float, res: StepResult) -> None:
        if r.output_ids is not None:
            tape, off, L = self._tape, r._tape_off, len(self._tape)
            i = (off + r.num_output) % L
            if i + n <= L:
                r.output_ids.extend(tape[i:i + n])
            else:
                r.output_ids.extend(tape[(i + j) % L] for j in range(n))
        r.num_output += n
        self.stats.generation_tokens += n
        res.tokens.append((r, n))
        if r.first_token_time is None:
            r.first_token_time = end
            self.stats.prompt_tokens += r.prompt_len
            res.first.append(r)
        r.last_token_time = end
        if r.num_output >= r.max_tokens:
            r.finish_reason = "length"
            r.finish_time = end
            self._free(r)
            self.requests.pop(r.req_id, None)
            self.stats.finished["length"] = self.stats.finished.get("length", 0) + 1
            res.finished.append(r)

    # -- the step ----------------------------------------------------------------------------
    def step(self, now: float) -> StepResult:
        cfg, kv = self.config, self.kv
        start = max(now, self.busy_until)
        if not self.running and self.waiting:  # an idle engine starts when the first request is there
            start = max(start, self.waiting[0].arrival)
        res = StepResult(start=start, duration=0.0)
        if not (self.running or self.waiting):
            return res
        bs, k = cfg.block_size, cfg.spec_tokens
        budget = cfg.max_num_batched_tokens
        sched: list[tuple[Request, int, int]] = []
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            look = 0
            if r.in_decode:
                if k:
                    look = max(0, min(k, r.max_tokens - r.num_output - 1, budget - 1))
                n = 1 + look
            else:
                n = min(r.num_tokens - r.num_computed, budget)
            need = _cdiv(r.num_computed + n, bs) - len(r.blocks)
            self_preempted = False
            while need > kv.num_free:
                victim = running.pop()
                self._preempt(victim)
                res.preempted.append(victim)
                if victim is r:
                    self_preempted = True
                    break
            if self_preempted:
                break
            if need > 0:
                r.blocks.extend(kv.allocate(need))
            sched.append((r, n, look))
            budget -= n
            i += 1
        if not res.preempted:
            waiting = self.waiting
            while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
                r = waiting[0]
                if r.arrival > start:  # never scheduled before it arrives
                    break
                max_hit = (r.num_tokens - 1) // bs
                hits = kv.match(self._hashes(r, max_hit), max_hit) if kv.enable_prefix_caching else []
                n_cached = len(hits) * bs
                n = min(r.num_tokens - n_cached, budget)
                need = _cdiv(n_cached + n, bs) - len(hits)
                if not kv.can_allocate(hits, need):
                    break
                kv.share(hits)
                r.blocks = hits + kv.allocate(need)
                waiting.popleft()
                running.append(r)
                r.num_computed = n_cached
                r.num_stored = len(hits)
                if r.num_cached_tokens < 0:
                    r.num_cached_tokens = n_cached
                    r.scheduled_time = start
                self.stats.prefix_cache_queries += r.num_tokens
                self.stats.prefix_cache_hits += n_cached
                sched.append((r, n, 0))
                budget -= n
        if not sched:
            return res
        prefill = decode = kv_read = kv_dec = 0
        for r, n, _ in sched:
            if r.in_decode:
                decode += 1
                kv_dec += r.num_computed + n
            else:
                prefill += n
            kv_read += r.num_computed + n
        cost = self.cost
        duration = cost.step_time_s(prefill, decode, kv_read)
        if k and decode:
            duration += cost.spec_step_time_s(decode, kv_dec) - cost.step_time_s(0, decode, kv_dec)
        end = start + duration
        res.duration, res.steps, res.prefill_tokens, res.decode_seqs = duration, 1, prefill, decode
        self.busy_until = end
        self.stats.steps += 1
        self.stats.busy_time += duration
        a, rnd, st = cfg.spec_acceptance, self._rng.random, self.stats
        for r, n, look in sched:
            if r.in_decode:
                acc = 0
                if look:
                    while acc < look and rnd() < a:
                        acc += 1
                    st.spec_drafts += 1
                    st.spec_draft_tokens += look
                    st.spec_accepted_tokens += acc
                r.num_computed += 1 + acc
                produced = 1 + acc
            else:
                r.num_computed += n
                produced = 0
                if r.num_computed >= r.num_tokens:
                    r.in_decode = True
                    produced = 1
            self._store(r)
            if produced:
                self._emit(r, produced, end, res)
        if res.finished:
            self.running = [r for r in running if r.finish_reason is None]
        return res

    def fast_forward(self, now: float, until: float = float("inf"), max_steps: int = 1 << 30) -> StepResult:
        """Run several decode-only steps in one call, O(batch + log steps), when that is exactly
        what ``step`` would do: every running request decoding, no speculative decoding,
        and nothing waiting or the first waiting request cannot be admitted (batch full or
        not enough free blocks). Stops at the first finish (included), after ``max_steps``, or
        after the step that ends at or past ``until`` (e.g. the next arrival). Otherwise it
        is one ordinary :meth:`step`. Per-token times inside the window are not reported:
        ``tokens`` holds each request's total for the window, stamped at ``end``."""
        running = self.running
        if not running or self.config.spec_tokens or max_steps <= 1 \
                or not all(r.in_decode for r in running) or (self.waiting and not self._head_blocked()):
            return self.step(now)
        start = max(now, self.busy_until)
        bs = self.config.block_size
        n = min(max_steps, min(r.max_tokens - r.num_output for r in running))
        need = sum(max(0, _cdiv(r.num_computed + n, bs) - len(r.blocks)) for r in running)
        if need > self.kv.num_free:  # stay within the blocks already held
            n = min(n, min(len(r.blocks) * bs - r.num_computed for r in running))
            need = 0
        if n <= 1:
            return self.step(now)
        batch = len(running)
        kv0 = sum(r.num_computed for r in running)
        steps, total = self._decode_window(start, until, n, batch, kv0)
        end = start + total
        res = StepResult(start=start, duration=total, steps=steps, decode_seqs=batch)
        self.busy_until = end
        self.stats.steps += steps
        self.stats.busy_time += total
        for r in running:
            grow = _cdiv(r.num_computed + steps, bs) - len(r.blocks)
            if grow > 0:
                r.blocks.extend(self.kv.allocate(grow))
            r.num_computed += steps
            self._store(r)
            self._emit(r, steps, end, res)
        if res.finished:
            self.running = [r for r in running if r.finish_reason is None]
        return res

    def _head_blocked(self) -> bool:
        """True when ``step`` could not admit the first waiting request now. During a
        decode-only window that stays true: the batch is unchanged and free blocks only
        decrease, so the window may run with requests waiting."""
        cfg, kv = self.config, self.kv
        running = self.running
        budget = cfg.max_num_batched_tokens - len(running)
        if len(running) >= cfg.max_num_seqs or budget <= 0:
            return True
        r = self.waiting[0]
        bs = cfg.block_size
        max_hit = (r.num_tokens - 1) // bs
        hits = kv.match(self._hashes(r, max_hit), max_hit) if kv.enable_prefix_caching else []
        n_cached = len(hits) * bs
        need = _cdiv(n_cached + min(r.num_tokens - n_cached, budget), bs) - len(hits)
        return not kv.can_allocate(hits, need)

    def _decode_window(self, start: float, until: float, n: int, batch: int, kv0: int) -> tuple[int, float]:
        """(steps, total time) of up to ``n`` decode steps of ``batch`` sequences starting with
        ``kv0`` computed tokens, stopping after the step that ends at or past ``until``.
        When the step time is affine in the KV read over the window (checked at five points;
        the roofline is, while memory-bound) the sum is an arithmetic series, O(log n);
        otherwise step by step."""
        step_time = self.cost.step_time_s

        def f(j: int) -> float:
            return step_time(0, batch, kv0 + batch * j)

        if n >= 16:
            f1, fn = f(1), f(n)
            d = (fn - f1) / (n - 1)
            tol = 1e-9 * max(abs(fn), abs(f1))
            if all(abs(f(j) - (f1 + d * (j - 1))) <= tol for j in (n // 4, n // 2, (3 * n) // 4)):
                def total(j: int) -> float:
                    return j * f1 + d * j * (j - 1) / 2

                if start + total(n) < until:
                    return n, total(n)
                lo, hi = 1, n  # smallest j with start + total(j) >= until
                while lo < hi:
                    mid = (lo + hi) // 2
                    if start + total(mid) >= until:
                        hi = mid
                    else:
                        lo = mid + 1
                return lo, total(lo)
        acc, steps = 0.0, 0
        while steps < n:
            steps += 1
            acc += f(steps)
            if start + acc >= until:
                break
        return steps, acc
