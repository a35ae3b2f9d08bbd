"""Small pieces shared by the router's tokenizers: the token-id list type, the check that a
JSON value is a non-empty list of ids, and a bounded LRU map with hit/miss counts."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

Ids = list[int]


class LRU:
    """A bounded least-recently-used map (keys → values); ``hits``/``misses`` counted."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self._d: OrderedDict[Any, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: Any) -> Any:
        v = self._d.get(key)
        if v is None:
            self.misses += 1
            return None
        self.hits += 1
        self._d.move_to_end(key)
        return v

    def put(self, key: Any, value: Any) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        if len(self._d) > self.size:
            self._d.popitem(last=False)

    def __len__(self) -> int:
        return len(self._d)


def is_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(type(t) is int for t in v)

