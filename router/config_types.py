"""The router's configuration tree: :class:`ConfigError` and the frozen dataclasses, one per
section, with their defaults. Loading, environment/CLI overrides and validation are in
:mod:`router.config`, which re-exports every name here (import them from there). Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """An invalid configuration; ``str()`` starts with the dotted key at fault."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


@dataclass(frozen=True, slots=True)
class ListenConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1  # router processes on this port (router/workers.py; SO_REUSEPORT)
    reuse_port: bool = False  # bind with SO_REUSEPORT (set for each worker when workers > 1)


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    name: str = "cache_aware"
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    tokenizer: str = "builtin"  # builtin | backend | PATH (tokenizer.json or model dir)
    block_size: int = 16


@dataclass(frozen=True, slots=True)
class IndexConfig:
    backend: str = "memory"  # memory | redis
    url: str | None = None
    namespace: str = "kvrouter"
    ttl_s: float = 3600.0
    capacity_blocks: int = 100_000
    cluster: bool = False  # url names Redis Cluster seed node(s) (router/index/cluster.py)
    approx_ttl_s: float = 30.0  # exact tracking: how long a router record waits for the engine's event


@dataclass(frozen=True, slots=True)
class ReplicaKVEvents:
    """Where the replica's engine publishes KV events (see docs/kv-events.md)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    bind: bool | None = None  # None: bind when the endpoint's host is * or ::


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    id: str
    url: str
    models: tuple[str, ...]
    api_key: str | None = None
    capacity_blocks: int | None = None
    kv_events: ReplicaKVEvents | None = None


@dataclass(frozen=True, slots=True)
class HealthConfig:
    path: str = "/health"
    interval_s: float = 2.0
    timeout_s: float = 1.0
    failure_threshold: int = 2
    success_threshold: int = 1
    eject_on_connect_error: bool = True


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    enabled: bool = True
    path: str = "/metrics"
    interval_s: float = 1.0
    timeout_s: float = 1.0


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 300.0
    idle_timeout_s: float = 120.0
    total_timeout_s: float = 900.0
    max_retries: int = 2
    retry_backoff_s: float = 0.05
    retry_backoff_max_s: float = 1.0
    max_connections_per_replica: int = 1000


@dataclass(frozen=True, slots=True)
class AuthConfig:
    api_keys: tuple[str, ...] = ()
    admin_key: str | None = None
    metrics_public: bool = True


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    max_body_bytes: int = 16 * 1024 * 1024
    max_concurrent: int = 4096
    retry_after_s: int = 1
    max_header_line_bytes: int = 8190
    max_header_field_bytes: int = 8190
    max_headers: int = 128
    max_connections: int = 10_000  # open client connections; beyond: 503 and closed
    client_idle_timeout_s: float = 75.0  # idle (or silent since connect) client connection closed
    client_write_timeout_s: float = 60.0  # a client not reading a response for this long is cut off
    rate_limit_rps: float = 0.0  # requests per second per API key (0 = no limit)
    rate_limit_burst: int = 0  # bucket size (0 = ceil(rate_limit_rps))


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Per-replica circuit breaker on real requests (router/breaker.py)."""

    enabled: bool = True
    failure_threshold: int = 5  # consecutive failed attempts that open it
    open_s: float = 10.0  # no traffic for this long, then one probe at a time
    success_threshold: int = 2  # successful probes that close it


@dataclass(frozen=True, slots=True)
class HeadersConfig:
    replica_header: str = "x-kvrouter-replica"  # empty string: not sent
    request_id_header: str = "x-request-id"


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    level: str = "info"
    format: str = "text"  # text | json
    requests: bool = True  # one line per request


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """Where replicas come from besides ``replicas`` (see router/discovery.py, docs/deployment.md)."""

    mode: str = "static"  # static | dns | kubernetes
    name: str = ""  # dns: host name to resolve (a headless Service); kubernetes: the Service name
    port: int = 8000  # dns: the engines' port (kubernetes: from the EndpointSlice)
    scheme: str = "http"
    models: tuple[str, ...] = ()  # the models every discovered replica serves
    interval_s: float = 5.0  # seconds between two resolutions
    api_key: str | None = None  # bearer key sent to discovered replicas
    namespace: str | None = None  # kubernetes: default the pod's own namespace
    port_name: str | None = None  # kubernetes: which EndpointSlice port (default: the first)


@dataclass(frozen=True, slots=True)
class LifecycleConfig:
    """Graceful shutdown and reload (see router/lifecycle.py)."""

    shutdown_grace_s: float = 30.0  # SIGTERM: longest wait for in-flight requests before exit
    drain_delay_s: float = 0.0  # SIGTERM: keep serving this long with /ready failing, then stop accepting
    watch_config_s: float = 0.0  # poll the config file every N s and reload on change (0 = SIGHUP only)


@dataclass(frozen=True, slots=True)
class SharedLoadConfig:
    """In-flight counts shared between router processes through Redis (router/reservations.py)."""

    enabled: bool = False
    url: str | None = None  # default: index.url
    cluster: bool | None = None  # default: index.cluster
    namespace: str = "kvrouter"
    interval_s: float = 0.02  # seconds between two syncs (publish own counts, read the others')
    ttl_s: float = 2.0  # a silent (crashed) process's counts expire after this long


@dataclass(frozen=True, slots=True)
class Config:
    listen: ListenConfig = field(default_factory=ListenConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    models: Mapping[str, ModelConfig] = field(default_factory=dict)
    index: IndexConfig = field(default_factory=IndexConfig)
    replicas: tuple[ReplicaConfig, ...] = ()
    health: HealthConfig = field(default_factory=HealthConfig)
    scrape: ScrapeConfig = field(default_factory=ScrapeConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    headers: HeadersConfig = field(default_factory=HeadersConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    shared_load: SharedLoadConfig = field(default_factory=SharedLoadConfig)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Config:
        from router.config import build_config  # validation lives there (it builds this class)

        return build_config(d or {})

    @classmethod
    def from_file(cls, path: str | Path) -> Config:
        from router.config import read_yaml

        return cls.from_dict(read_yaml(path))

    def model_names(self) -> list[str]:
        """Every model some replica serves, in first-seen order."""
        seen: dict[str, None] = {}
        for r in self.replicas:
            for m in r.models:
                seen.setdefault(m, None)
        if self.discovery.mode != "static":
            for m in self.discovery.models:
                seen.setdefault(m, None)
        return list(seen)

    def model(self, name: str) -> ModelConfig:
        return self.models.get(name) or ModelConfig()

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, tuple | list):
        return [_plain(x) for x in v]
    return v
