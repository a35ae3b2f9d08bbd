"""Hit-rate accounting for traces: what fraction of prompt tokens a prefix cache can serve.

Two ideal figures bound what any routing policy can reach on a trace:

- **ideal infinite**: one cache shared by the whole fleet that never evicts; a request hits
  the longest prefix of its blocks that any earlier request already had.
- **ideal pooled LRU**: one LRU cache as large as the whole fleet (``capacity_blocks``
  trace blocks); every request reads its longest cached prefix, then all its blocks become
  most recently used (missing ones are inserted, the least recently used evicted).

Requests are processed in arrival order, each one fully before the next. Figures are
token-weighted (a partial last block weighs its real tokens) and block-weighted. Keys are
the chain of ``hash_ids`` (``key_i = hash((key_{i-1}, id_i))``), so the accounting is
right even for traces whose ids are not themselves prefix-chained. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from loadtest.traces.types import TraceRequest


@dataclass(frozen=True, slots=True)
class HitStats:
    """Token- and block-weighted hit counts over a set of requests."""

    hit_tokens: int = 0
    total_tokens: int = 0
    hit_blocks: int = 0
    total_blocks: int = 0

    @property
    def token_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def block_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0

    def __add__(self, o: HitStats) -> HitStats:
        return HitStats(self.hit_tokens + o.hit_tokens, self.total_tokens + o.total_tokens,
                        self.hit_blocks + o.hit_blocks, self.total_blocks + o.total_blocks)


def chain_keys(hash_ids: Sequence[int]) -> list[int]:
    """Prefix-chained keys of a request's block ids (equal keys ⇔ equal prefixes)."""
    out = []
    k = 0
    for h in hash_ids:
        k = hash((k, h))
        out.append(k)
    return out


def hit_tokens(req: TraceRequest, matched_blocks: int) -> int:
    """Prompt tokens covered by the first ``matched_blocks`` blocks of ``req``."""
    return min(req.input_length, matched_blocks * req.block_size)


def request_stats(req: TraceRequest, matched_blocks: int) -> HitStats:
    """One request's contribution when its first ``matched_blocks`` blocks hit."""
    return HitStats(hit_tokens(req, matched_blocks), req.input_length, matched_blocks, len(req.hash_ids))


def ideal_infinite(requests: Iterable[TraceRequest]) -> HitStats:
    """Hits with one never-evicting cache shared by the whole fleet."""
    seen: set[int] = set()
    ht = tt = hb = tb = 0
    for r in requests:
        keys = chain_keys(r.hash_ids)
        m = 0
        for k in keys:
            if k not in seen:
                break
            m += 1
        seen.update(keys)
        ht += hit_tokens(r, m)
        tt += r.input_length
        hb += m
        tb += len(keys)
    return HitStats(ht, tt, hb, tb)


class LRUBlocks:
    """An LRU set of block keys bounded to ``capacity`` entries (pure)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._d: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: int) -> bool:
        return key in self._d

    def access(self, keys: Sequence[int]) -> int:
        """Longest cached prefix of ``keys`` (in blocks); then every key becomes most
        recently used — the first key most recent of all, so a prefix outlives its tails."""
        d = self._d
        m = 0
        for k in keys:
            if k not in d:
                break
            m += 1
        if self.capacity == 0:
            return m
        # Insert/touch deepest first so the shared head ends up most recently used; a
        # prompt longer than the whole cache keeps its head (a tail alone never hits).
        for k in reversed(keys[: self.capacity]):
            if k in d:
                d.move_to_end(k)
            else:
                d[k] = None
        while len(d) > self.capacity:
            d.popitem(last=False)
        return m


def ideal_pooled_lru(requests: Iterable[TraceRequest], capacity_blocks: int) -> HitStats:
    """Hits with one LRU cache of ``capacity_blocks`` trace blocks shared by the fleet."""
    lru = LRUBlocks(capacity_blocks)
    ht = tt = hb = tb = 0
    for r in requests:
        keys = chain_keys(r.hash_ids)
        m = lru.access(keys)
        ht += hit_tokens(r, m)
        tt += r.input_length
        hb += m
        tb += len(keys)
    return HitStats(ht, tt, hb, tb)


def capacity_in_trace_blocks(fleet_kv_tokens: int, block_size: int) -> int:
    """How many trace blocks of ``block_size`` tokens fit in ``fleet_kv_tokens`` tokens."""
    return max(0, fleet_kv_tokens // block_size)
