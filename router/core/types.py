"""Value types the scheduler works on: a replica's load snapshot, the request as the
scheduler sees it, and the decision it returns. Plain data, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ReplicaState:
    """One replica as the scheduler sees it at one instant.

    ``in_flight`` is the router's own count (exact, immediate). ``running``/``waiting``/
    ``kv_usage`` come from the engine's scraped ``/metrics`` (vLLM or SGLang names) and lag
    by up to one scrape interval; ``None``-free: unknown values are 0.
    ``reserved`` is load reserved by other router processes (shared accounting).
    """

    id: str
    url: str = ""
    models: tuple[str, ...] = ()
    healthy: bool = True
    in_flight: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    capacity_blocks: int | None = None
    reserved: float = 0.0

    @property
    def load(self) -> float:
        """Requests on this replica: the larger of the router's own count (plus what other
        routers reserved) and what the engine last reported as running + waiting."""
        return max(self.in_flight + self.reserved, self.running + self.waiting)


@dataclass(slots=True)
class RoutingRequest:
    """What the scheduler knows about one request.

    ``hashes`` are the chained block hashes of the prompt (empty when the policy does not
    need them); ``num_tokens`` the prompt length in tokens (0 when unknown).
    """

    model: str
    hashes: list[int] = field(default_factory=list)
    num_tokens: int = 0
    block_size: int = 16
    session_key: str | None = None
    request_id: str = ""
    exclude: frozenset[str] = frozenset()  # replicas already tried (retries)


@dataclass(slots=True)
class Decision:
    """The scheduler's answer: which replica, why, and the per-replica scores behind it."""

    replica: str
    reason: str
    policy: str
    matched_blocks: int = 0
    matched_tokens: int = 0
    scores: dict[str, float] = field(default_factory=dict)


class NoReplicaError(Exception):
    """No eligible replica (none healthy, or all excluded) for the request's model."""
