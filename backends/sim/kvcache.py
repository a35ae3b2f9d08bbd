"""The simulated engine's paged KV cache: fixed-size blocks, prefix caching, LRU eviction.

Modelled on vLLM v1's block pool:

* ``num_blocks`` blocks of ``block_size`` tokens; each has a reference count and, once its
  tokens are computed and it is full, a chained block hash under which it is *cached*;
* a request's prompt is matched block by block against the cached hashes (the longest
  run of leading hits); hit blocks are shared (reference counted), never copied;
* the free queue holds every block with no reference, least recently used first. A freed
  block keeps its hash (it can still be hit) until it is taken for new tokens, which
  evicts it. A request frees its blocks tail-first, so its last block is evicted before
  its first, as vLLM does;
* ``usage()`` is ``1 - free / total`` (vLLM's ``kv_cache_usage_perc``: evictable cached
  blocks count as free).

Optionally every change is recorded as a KV event (:class:`BlockStored`,
:class:`BlockRemoved`, :class:`AllBlocksCleared`, field names as vLLM publishes them) in a
list that a publisher empties with :meth:`KVCache.drain_events`. Recording is off by
default so that a long offline simulation does not accumulate millions of events.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks just cached, chained after ``parent_block_hash`` (None for a first block).
    ``token_ids`` holds ``block_size`` ids per block (empty when the request carried no ids)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    cache_salt: str | None = None  # the request's salt when the chain starts here (parent None)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks evicted (one event per block, as vLLM sends them)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (``POST /reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVCache:
    """Paged blocks with prefix caching. Block ids are ``0 .. num_blocks-1``."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 record_events: bool = False) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.record_events = record_events
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.events: list[KVCacheEvent] = []
        self.evictions = 0  # cached blocks evicted since start

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be taken now (unreferenced, cached or not)."""
        return len(self.free)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def match(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids of the longest run of leading ``hashes`` that are cached (at most
        ``max_blocks``). Takes no reference."""
        out: list[int] = []
        if not self.enable_prefix_caching:
            return out
        get = self.cached.get
        for i in range(min(max_blocks, len(hashes))):
            b = get(hashes[i])
            if b is None:
                break
            out.append(b)
        return out

    def cached_hashes(self) -> list[int]:
        return list(self.cached)

    # -- allocation --------------------------------------------------------------------------
    def can_allocate(self, hit_blocks: Sequence[int], num_new: int) -> bool:
        """Whether ``hit_blocks`` can be shared and ``num_new`` fresh blocks taken."""
        ref = self.ref
        reviving = sum(1 for b in hit_blocks if ref[b] == 0)
        return num_new + reviving <= len(self.free)

    def share(self, hit_blocks: Sequence[int]) -> None:
        """Take a reference on cache-hit blocks (removing free ones from the free queue)."""
        ref, free = self.ref, self.free
        for b in hit_blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue (evicting cached ones).
        The caller checks :meth:`can_allocate` first; raises if there are too few.
        (Bulk list operations: this is the hot path of long offline simulations.)"""
        free = self.free
        if n > len(free):
            raise MemoryError(f"need {n} blocks, {len(free)} free")
        pop = free.popitem
        out = [pop(False)[0] for _ in range(n)]
        hash_of = self.hash_of
        evicted = [h for h in map(hash_of.__getitem__, out) if h is not None]
        if evicted:
            # invariant: hash_of[b] == h  <=>  cached[h] == b
            for h in evicted:
                hash_of[self.cached.pop(h)] = None
            self.evictions += len(evicted)
            if self.record_events:
                self.events.extend(BlockRemoved((h,)) for h in evicted)
        ref = self.ref
        for b in out:
            ref[b] = 1
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, tail first; unreferenced blocks join the end of
        the free queue (most recently used), keeping their hash."""
        ref, free = self.ref, self.free
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None

    def store(self, blocks: Sequence[int], hashes: Sequence[int], parent: int | None,
              token_ids: Sequence[int] = (), lora_name: str | None = None,
              cache_salt: str | None = None) -> int:
        """Register computed full ``blocks`` under ``hashes`` (same length). A hash already
        cached under another block is skipped (that block stays uncached). Returns the
        number newly cached; records one :class:`BlockStored` for them when enabled."""
        if not self.enable_prefix_caching or not blocks:
            return 0
        cached, hash_of = self.cached, self.hash_of
        contiguous = (not any(map(cached.__contains__, hashes))
                      and list(map(hash_of.__getitem__, blocks)).count(None) == len(blocks))
        if contiguous:  # the usual case: every hash new, every block unhashed
            n_before = len(cached)
            cached.update(zip(hashes, blocks, strict=True))
            if len(cached) - n_before != len(blocks):  # a hash repeated within `hashes`: undo
                for h in hashes:
                    cached.pop(h, None)
                contiguous = False
        if contiguous:
            for b, h in zip(blocks, hashes, strict=True):
                hash_of[b] = h
            new = len(blocks)
        else:  # one by one (hashes cached by another request, shared blocks, repeats)
            new = 0
            for b, h in zip(blocks, hashes, strict=True):
                if h in cached or hash_of[b] is not None:
                    continue
                cached[h] = b
                hash_of[b] = h
                new += 1
        if self.record_events and new:
            if contiguous:
                self.events.append(BlockStored(tuple(hashes), parent, tuple(token_ids),
                                               self.block_size, lora_name, cache_salt if parent is None else None))
            else:  # rare: report only the blocks newly cached, each after its chain parent
                bs = self.block_size
                prev = parent
                for i, (b, h) in enumerate(zip(blocks, hashes, strict=True)):
                    if cached.get(h) == b:
                        toks = tuple(token_ids[i * bs:(i + 1) * bs]) if token_ids else ()
                        self.events.append(BlockStored((h,), prev, toks, bs, lora_name,
                                                       cache_salt if prev is None else None))
                    prev = h
        return new

    def reset(self) -> bool:
        """Forget every cached hash (blocks in use stay allocated, uncached)."""
        self.cached.clear()
        self.hash_of = [None] * self.num_blocks
        if self.record_events:
            self.events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVCacheEvent]:
        out, self.events = self.events, []
        return out
