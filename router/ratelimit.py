"""Per-client request rate limits: one token bucket per API key. Pure: time is passed in.

``limits.rate_limit_rps`` tokens are added per second up to ``limits.rate_limit_burst``; a
request takes one, and a request that finds the bucket empty is refused (the server answers
429 with ``Retry-After``). The key is the client's API key — stored as a keyed digest
(never the key itself) — or, without one, the client's address. The table is bounded:
beyond ``max_keys`` the least recently seen bucket is dropped (a dropped key simply starts
again with a full bucket).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import OrderedDict


class RateLimiter:
    """``allow(key, now) -> (allowed, retry_after_s)``."""

    def __init__(self, rate: float, burst: int | None = None, max_keys: int = 100_000) -> None:
        if rate <= 0:
            raise ValueError("rate must be > 0")
        self.rate = float(rate)
        self.burst = float(burst if burst and burst > 0 else max(1, math.ceil(rate)))
        self.max_keys = max_keys
        self._salt = os.urandom(16)
        self._buckets: OrderedDict[bytes, list[float]] = OrderedDict()  # digest -> [tokens, last]

    def _digest(self, key: bytes) -> bytes:
        return hashlib.blake2b(key, key=self._salt, digest_size=16).digest()

    def allow(self, key: bytes, now: float) -> tuple[bool, float]:
        d = self._digest(key)
        b = self._buckets.get(d)
        if b is None:
            b = [self.burst, now]
            self._buckets[d] = b
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(d)
            b[0] = min(self.burst, b[0] + (now - b[1]) * self.rate)
            b[1] = now
        if b[0] >= 1.0:
            b[0] -= 1.0
            return True, 0.0
        return False, (1.0 - b[0]) / self.rate

    def __len__(self) -> int:
        return len(self._buckets)
