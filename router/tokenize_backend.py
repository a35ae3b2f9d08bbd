"""The ``backend`` tokenizer kind: a replica's ``POST /tokenize`` (vLLM's API), one call per
distinct prompt (round-robin over the replicas, at most two tries), answers kept in a bounded LRU."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.tokenize_util import LRU, Ids
from router.tokenize_util import is_ids as _is_ids


class BackendTokenizer:
    """``POST /tokenize`` on a replica (vLLM's API), answers cached in a bounded LRU."""

    def __init__(self, urls: Sequence[str], api_key: str | None = None, timeout_s: float = 2.0,
                 cache_entries: int = 4096) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.cache = LRU(cache_entries)
        self.calls = 0
        self.failures = 0
        self._session: Any = None
        self._next = 0

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def tokens(self, payload: Mapping[str, Any]) -> Ids | None:
        import aiohttp
        import orjson

        try:
            key = orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)
        except TypeError:
            return None
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        if not self.urls:
            return None
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        headers = {"content-type": "application/json"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        for attempt in range(min(2, len(self.urls))):
            url = self.urls[(self._next + attempt) % len(self.urls)]
            self.calls += 1
            try:
                async with self._session.post(f"{url}/tokenize", data=key, headers=headers) as resp:
                    if resp.status != 200:
                        self.failures += 1
                        continue
                    data = await resp.json(loads=orjson.loads)
                ids = data.get("tokens") if isinstance(data, Mapping) else None
                if _is_ids(ids):
                    self._next += 1
                    self.cache.put(key, ids)
                    return ids
                self.failures += 1
            except Exception:
                self.failures += 1
        return None
