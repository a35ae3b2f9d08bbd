"""The in-memory prefix index: which replica holds which KV block, bounded per replica.

Pure (no I/O, no clock: ``now`` is passed in). Keys are chained block hashes from
:mod:`router.core.hashing`; since the chain is seeded by model, LoRA and cache salt, one
hash already names (model, whole prefix) and the index stores hashes without the model.

Structure
  * ``_lru[replica]``: an ``OrderedDict`` hash → time last recorded, least recently used
    first, holding at most ``capacity(replica)`` blocks (the replica's real KV capacity).
    A record inserts a chain tail-first, so the chain's first block is the most recently
    used and eviction drops the tails of prefixes before their heads — as engines do
    (vLLM frees a request's blocks in reverse order). Present blocks therefore stay
    prefix-closed, which is what lets the Redis index binary-search a chain.
  * ``_blocks``: hash → set of replicas that may hold it (a candidate set; the replica's
    LRU is the truth).
  * ``clear(replica)`` is O(1): the replica's LRU is swapped for an empty one and its
    generation number bumped; the old map goes to a graveyard that later ``record`` calls
    purge from ``_blocks`` a bounded number of entries at a time, so memory stays bounded
    by the sum of capacities plus the not-yet-purged graveyard.
  * TTL: an entry not re-recorded within ``ttl_s`` no longer matches (and is evicted by
    LRU pressure like any other).

Lookup walks the chain once, intersecting the replicas still matching: O(matched blocks ×
replicas holding them).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence

DEFAULT_CAPACITY = 100_000


class PrefixIndex:
    """Block hash → replicas, with per-replica LRU capacity, TTL and O(1) clear."""

    def __init__(self, default_capacity: int = DEFAULT_CAPACITY,
                 capacities: Mapping[str, int] | None = None, ttl_s: float | None = None,
                 purge_batch: int = 256) -> None:
        if default_capacity <= 0:
            raise ValueError("default_capacity must be positive")
        self.default_capacity = int(default_capacity)
        self._capacity: dict[str, int] = {k: int(v) for k, v in (capacities or {}).items()}
        self.ttl_s = ttl_s
        self.purge_batch = purge_batch
        self._lru: dict[str, OrderedDict[int, float]] = {}
        self._gen: dict[str, int] = {}
        self._blocks: dict[int, set[str]] = {}
        self._graveyard: deque[tuple[str, OrderedDict[int, float]]] = deque()
        self.evictions = 0

    # -- capacity ---------------------------------------------------------------------
    def capacity(self, replica: str) -> int:
        return self._capacity.get(replica, self.default_capacity)

    def set_capacity(self, replica: str, blocks: int) -> None:
        """Set a replica's capacity in blocks (evicting least recently used blocks now)."""
        if blocks <= 0:
            raise ValueError("capacity must be positive")
        self._capacity[replica] = int(blocks)
        lru = self._lru.get(replica)
        if lru is not None:
            self._trim(replica, lru)

    # -- queries ----------------------------------------------------------------------
    def generation(self, replica: str) -> int:
        """Bumped by every ``clear(replica)``."""
        return self._gen.get(replica, 0)

    def size(self, replica: str) -> int:
        lru = self._lru.get(replica)
        return len(lru) if lru is not None else 0

    def replicas(self) -> list[str]:
        return [r for r, lru in self._lru.items() if lru]

    def __len__(self) -> int:
        return sum(len(lru) for lru in self._lru.values())

    def lookup(self, hashes: Sequence[int], now: float = 0.0,
               replicas: Iterable[str] | None = None) -> dict[str, int]:
        """Replica → number of consecutive blocks of ``hashes`` (from the first) it holds.
        Replicas with no match are absent. ``replicas`` restricts the answer."""
        if not hashes:
            return {}
        cands = self._blocks.get(hashes[0])
        if not cands:
            return {}
        allowed = set(replicas) if replicas is not None else None
        h0 = hashes[0]
        alive = [r for r in cands if (allowed is None or r in allowed) and self._valid(r, h0, now)]
        out: dict[str, int] = {}
        i = 1
        n = len(hashes)
        blocks = self._blocks
        while alive and i < n:
            h = hashes[i]
            s = blocks.get(h)
            if not s:
                break
            nxt = []
            for r in alive:
                if r in s and self._valid(r, h, now):
                    nxt.append(r)
                else:
                    out[r] = i
            alive = nxt
            i += 1
        for r in alive:
            out[r] = i
        return out

    def _valid(self, replica: str, h: int, now: float) -> bool:
        lru = self._lru.get(replica)
        if lru is None:
            return False
        stamp = lru.get(h)
        if stamp is None:
            return False
        return self.ttl_s is None or now - stamp <= self.ttl_s

    # -- updates ----------------------------------------------------------------------
    def record(self, hashes: Sequence[int], replica: str, now: float = 0.0) -> None:
        """``replica`` now holds every block of ``hashes`` (refreshes their LRU position)."""
        lru = self._lru.get(replica)
        if lru is None:
            lru = self._lru[replica] = OrderedDict()
        blocks = self._blocks
        move = lru.move_to_end
        for h in reversed(hashes):  # tail first: the chain's head ends most recently used
            if h in lru:
                lru[h] = now
                move(h)
            else:
                lru[h] = now
                s = blocks.get(h)
                if s is None:
                    blocks[h] = {replica}
                else:
                    s.add(replica)
        self._trim(replica, lru)
        if self._graveyard:
            self._purge(max(self.purge_batch, 2 * len(hashes)))

    def remove(self, replica: str, hashes: Iterable[int]) -> None:
        """``replica`` no longer holds these blocks (engine eviction events)."""
        lru = self._lru.get(replica)
        if lru is None:
            return
        for h in hashes:
            if lru.pop(h, None) is not None:
                self._drop(h, replica)

    def clear(self, replica: str) -> None:
        """Forget every block of ``replica`` in O(1) (the old entries are purged lazily)."""
        self._gen[replica] = self._gen.get(replica, 0) + 1
        old = self._lru.pop(replica, None)
        if old:
            self._graveyard.append((replica, old))

    def purge(self) -> None:
        """Finish purging cleared replicas' entries now (tests, shutdown)."""
        self._purge(None)

    # -- internals --------------------------------------------------------------------
    def _drop(self, h: int, replica: str) -> None:
        s = self._blocks.get(h)
        if s is not None:
            s.discard(replica)
            if not s:
                del self._blocks[h]

    def _trim(self, replica: str, lru: OrderedDict[int, float]) -> None:
        cap = self.capacity(replica)
        while len(lru) > cap:
            h, _ = lru.popitem(last=False)
            self._drop(h, replica)
            self.evictions += 1

    def _purge(self, budget: int | None) -> None:
        while self._graveyard and (budget is None or budget > 0):
            replica, old = self._graveyard[0]
            current = self._lru.get(replica)
            while old and (budget is None or budget > 0):
                h, _ = old.popitem()
                if current is None or h not in current:
                    self._drop(h, replica)
                if budget is not None:
                    budget -= 1
            if not old:
                self._graveyard.popleft()
