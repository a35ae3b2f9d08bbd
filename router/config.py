"""The router's configuration: loading, overrides and validation of one frozen dataclass tree
(the classes are in :mod:`router.config_types` and re-exported here), the only place options
become objects.

Sources, later ones winning: defaults < YAML file < ``KVROUTER_...`` environment variables
< CLI overrides (``section.key=value`` strings). Every value is validated once, at load
time, and a bad value raises :class:`ConfigError` naming the key and the problem, e.g.
``replicas[2].url: must be http(s)://host:port``.

Environment variables address keys with ``__`` between levels:
``KVROUTER_LISTEN__PORT=8001``, ``KVROUTER_POLICY__NAME=least_loaded``,
``KVROUTER_AUTH__API_KEYS=k1,k2``. Values are read as YAML scalars (so ``true``, ``3``,
``0.5`` and ``[a, b]`` work); a comma list is accepted where a list is expected.
Pure: no I/O besides reading the file in :meth:`Config.from_file` and checking that a
``models.<m>.tokenizer`` path exists. A bad value set by an environment variable is
reported under the variable's name (``KVROUTER_UPSTREAM__MAX_RETRIES (upstream.max_retries):
...``), with the variable in the error's ``source`` attribute.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from router.config_types import (  # noqa: F401  (re-exported: the public config names)
    AuthConfig,
    BreakerConfig,
    Config,
    ConfigError,
    DiscoveryConfig,
    HeadersConfig,
    HealthConfig,
    IndexConfig,
    LifecycleConfig,
    LimitsConfig,
    ListenConfig,
    LoggingConfig,
    ModelConfig,
    PolicyConfig,
    ReplicaConfig,
    ReplicaKVEvents,
    ScrapeConfig,
    SharedLoadConfig,
    UpstreamConfig,
)

ENV_PREFIX = "KVROUTER_"


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read file ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), f"invalid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), "top level must be a mapping")
    return data


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Sequence[str] | Mapping[str, Any] = (),
) -> Config:
    """File (optional) < ``KVROUTER_`` env (pass ``os.environ``; None means none) < overrides."""
    data: dict[str, Any] = read_yaml(path) if path else {}
    from_env: dict[str, str] = {}  # dotted key -> the env variable that set it
    for key, raw in sorted((env or {}).items()):
        if key.startswith(ENV_PREFIX) and "__" in key:
            dotted = ".".join(p.lower() for p in key[len(ENV_PREFIX):].split("__"))
            _set_path(data, dotted, _scalar(raw), source=key)
            from_env[dotted] = key
    items = overrides.items() if isinstance(overrides, Mapping) else (_split_override(o) for o in overrides)
    for dotted, val in items:
        _set_path(data, dotted, _scalar(val) if isinstance(val, str) else val, source=dotted)
        from_env.pop(dotted.strip(), None)
    try:
        return Config.from_dict(data)
    except ConfigError as exc:
        raise _blame_env(exc, from_env) from None


def _blame_env(exc: ConfigError, from_env: Mapping[str, str]) -> ConfigError:
    """``exc`` with its message naming the ``KVROUTER_...`` variable that set the bad key, if
    one did (``source`` then holds the variable, so a caller does not blame the file)."""
    for dotted, var in from_env.items():
        if exc.key == dotted or exc.key.startswith((dotted + ".", dotted + "[")):
            err = ConfigError(exc.key, exc.problem)  # .key stays the dotted key
            err.args = (f"{var} ({exc.key}): {exc.problem}",)
            err.source = var  # type: ignore[attr-defined]
            return err
    return exc


def env_overrides() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}


def _split_override(o: str) -> tuple[str, str]:
    if "=" not in o:
        raise ConfigError(o, "override must be KEY=VALUE (e.g. listen.port=8001)")
    k, v = o.split("=", 1)
    return k.strip(), v


def _scalar(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


_INDEX = re.compile(r"^(\w+)\[(\d+)\]$")


def _set_path(data: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(source, "empty key")
    cur: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        m = _INDEX.match(part)
        if m:
            name, idx = m.group(1), int(m.group(2))
            lst = cur.setdefault(name, [])
            if not isinstance(lst, list) or idx >= len(lst):
                raise ConfigError(source, f"{name}[{idx}] does not exist")
            if last:
                lst[idx] = value
            else:
                if not isinstance(lst[idx], dict):
                    raise ConfigError(source, f"{name}[{idx}] is not a mapping")
                cur = lst[idx]
            continue
        if last:
            cur[part] = value
        else:
            nxt = cur.get(part)
            if nxt is None:
                nxt = cur[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(source, f"{part} is not a mapping")
            cur = nxt


# ---------------------------------------------------------------- validation helpers


def _mapping(v: Any, key: str) -> Mapping[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ConfigError(key, f"must be a mapping, got {type(v).__name__}")
    return v


def _section(cls: type, raw: Any, key: str, checks: Mapping[str, Any]) -> Any:
    """Build a flat dataclass section from ``raw``, type-checking each field."""
    d = dict(_mapping(raw, key))
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", f"unknown key (known: {', '.join(sorted(names))})")
    out: dict[str, Any] = {}
    for name, v in d.items():
        check = checks.get(name)
        out[name] = check(v, f"{key}.{name}") if check else v
    return cls(**out)


def _int(lo: int | None = None, hi: int | None = None, optional: bool = False) -> Any:
    def f(v: Any, key: str) -> int | None:
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(key, f"must be an integer, got {v!r}")
        if lo is not None and v < lo:
            raise ConfigError(key, f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise ConfigError(key, f"must be <= {hi}, got {v}")
        return v

    return f


def _num(lo: float | None = None, positive: bool = False) -> Any:
    def f(v: Any, key: str) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ConfigError(key, f"must be a number, got {v!r}")
        if positive and v <= 0:
            raise ConfigError(key, f"must be > 0, got {v}")
        if lo is not None and v < lo:
            raise ConfigError(key, f"must be >= {lo}, got {v}")
        return float(v)

    return f


def _bool(v: Any, key: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(key, f"must be true or false, got {v!r}")
    return v


def _str(optional: bool = False, choices: Sequence[str] = (), nonempty: bool = True) -> Any:
    def f(v: Any, key: str) -> str | None:
        if v is None and optional:
            return None
        if not isinstance(v, str):
            raise ConfigError(key, f"must be a string, got {v!r}")
        if choices and v not in choices:
            raise ConfigError(key, f"must be one of {', '.join(choices)}, got {v!r}")
        if nonempty and not v:
            raise ConfigError(key, "must not be empty")
        return v

    return f


def _kv_events(v: Any, key: str) -> ReplicaKVEvents | None:
    if v is None:
        return None
    d = _mapping(v, key)
    if "endpoint" not in d:
        raise ConfigError(f"{key}.endpoint", "required (e.g. tcp://engine-host:5557)")
    ev = _section(ReplicaKVEvents, d, key, {
        "endpoint": _str(), "replay_endpoint": _str(optional=True), "topic": _str(nonempty=False),
        "bind": lambda b, k: None if b is None else _bool(b, k)})
    for name in ("endpoint", "replay_endpoint"):
        ep = getattr(ev, name)
        if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"{key}.{name}", "must be a ZMQ endpoint (tcp://, ipc:// or inproc://)")
    return ev


def _str_list(v: Any, key: str) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [s.strip() for s in v.split(",") if s.strip()]
    if v is None:
        return ()
    if not isinstance(v, list | tuple) or not all(isinstance(s, str) and s for s in v):
        raise ConfigError(key, "must be a list of non-empty strings")
    return tuple(v)


def _path(v: Any, key: str) -> str:
    if not isinstance(v, str) or not v.startswith("/"):
        raise ConfigError(key, f"must be a path starting with '/', got {v!r}")
    return v


def _tokenizer(v: Any, key: str) -> str:
    """``builtin``, ``backend``, or the path of a ``tokenizer.json`` or of a directory holding
    one — checked now, so ``config check`` catches what ``serve`` would die on."""
    spec: str = _str()(v, key)
    if spec in ("builtin", "backend"):
        return spec
    p = Path(spec)
    if p.is_file() or (p / "tokenizer.json").is_file():
        return spec
    if p.is_dir():
        raise ConfigError(key, f"directory {spec!r} holds no tokenizer.json")
    raise ConfigError(key, f"no such file or directory {spec!r} (builtin | backend | a tokenizer.json "
                           "file or a directory holding one)")


def _http_url(v: Any, key: str) -> str:
    if not isinstance(v, str):
        raise ConfigError(key, "must be http(s)://host:port")
    try:
        u = urlsplit(v)
        port = u.port
    except ValueError:
        raise ConfigError(key, "must be http(s)://host:port") from None
    if u.scheme not in ("http", "https") or not u.hostname or port is None or u.path not in ("", "/"):
        raise ConfigError(key, "must be http(s)://host:port")
    return v.rstrip("/")


def build_config(d: Mapping[str, Any]) -> Config:
    """The validated :class:`Config` of a plain mapping (what :meth:`Config.from_dict` calls)."""
    d = _mapping(d, "config")
    known = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(unknown[0], f"unknown section (known: {', '.join(sorted(known))})")
    listen = _section(ListenConfig, d.get("listen"), "listen",
                      {"host": _str(), "port": _int(0, 65535), "workers": _int(1, 256), "reuse_port": _bool})
    policy = _section(PolicyConfig, d.get("policy"), "policy",
                      {"name": _str(), "options": lambda v, k: dict(_mapping(v, k))})
    models: dict[str, ModelConfig] = {}
    for name, m in _mapping(d.get("models"), "models").items():
        key = f"models.{name}"
        models[str(name)] = _section(ModelConfig, m, key,
                                     {"tokenizer": _tokenizer, "block_size": _int(1, 1 << 20)})
    index = _section(IndexConfig, d.get("index"), "index", {
        "backend": _str(choices=("memory", "redis")), "url": _str(optional=True),
        "namespace": _str(), "ttl_s": _num(positive=True), "capacity_blocks": _int(1),
        "cluster": _bool, "approx_ttl_s": _num(positive=True)})
    if index.backend == "redis" and not index.url:
        raise ConfigError("index.url", "required when index.backend is redis")
    reps_raw = d.get("replicas") or []
    if not isinstance(reps_raw, list):
        raise ConfigError("replicas", "must be a list")
    replicas: list[ReplicaConfig] = []
    seen_ids: set[str] = set()
    for i, r in enumerate(reps_raw):
        key = f"replicas[{i}]"
        r = dict(_mapping(r, key))
        r.setdefault("id", f"r{i}")
        if "url" not in r:
            raise ConfigError(f"{key}.url", "required")
        if "models" not in r:
            raise ConfigError(f"{key}.models", "required (the model names this replica serves)")
        rep = _section(ReplicaConfig, r, key, {
            "id": lambda v, k: _str()(str(v) if isinstance(v, int) else v, k),
            "url": _http_url, "models": _str_list,
            "api_key": _str(optional=True), "capacity_blocks": _int(1, optional=True),
            "kv_events": _kv_events})
        if not rep.models:
            raise ConfigError(f"{key}.models", "must list at least one model")
        if rep.id in seen_ids:
            raise ConfigError(f"{key}.id", f"duplicate replica id {rep.id!r}")
        seen_ids.add(rep.id)
        replicas.append(rep)
    health = _section(HealthConfig, d.get("health"), "health", {
        "path": _path, "interval_s": _num(positive=True), "timeout_s": _num(positive=True),
        "failure_threshold": _int(1), "success_threshold": _int(1), "eject_on_connect_error": _bool})
    scrape = _section(ScrapeConfig, d.get("scrape"), "scrape", {
        "enabled": _bool, "path": _path, "interval_s": _num(positive=True), "timeout_s": _num(positive=True)})
    upstream = _section(UpstreamConfig, d.get("upstream"), "upstream", {
        "connect_timeout_s": _num(positive=True), "first_byte_timeout_s": _num(positive=True),
        "idle_timeout_s": _num(positive=True), "total_timeout_s": _num(positive=True),
        "max_retries": _int(0, 20), "retry_backoff_s": _num(lo=0), "retry_backoff_max_s": _num(lo=0),
        "max_connections_per_replica": _int(1)})
    auth = _section(AuthConfig, d.get("auth"), "auth", {
        "api_keys": _str_list, "admin_key": _str(optional=True), "metrics_public": _bool})
    limits = _section(LimitsConfig, d.get("limits"), "limits", {
        "max_body_bytes": _int(1), "max_concurrent": _int(1), "retry_after_s": _int(0),
        "max_header_line_bytes": _int(256), "max_header_field_bytes": _int(256), "max_headers": _int(8),
        "max_connections": _int(1), "client_idle_timeout_s": _num(positive=True),
        "client_write_timeout_s": _num(positive=True), "rate_limit_rps": _num(lo=0), "rate_limit_burst": _int(0)})
    breaker = _section(BreakerConfig, d.get("breaker"), "breaker", {
        "enabled": _bool, "failure_threshold": _int(1), "open_s": _num(positive=True),
        "success_threshold": _int(1)})
    headers = _section(HeadersConfig, d.get("headers"), "headers", {
        "replica_header": _str(nonempty=False), "request_id_header": _str()})
    logging_ = _section(LoggingConfig, d.get("logging"), "logging", {
        "level": _str(choices=("debug", "info", "warning", "error")),
        "format": _str(choices=("text", "json")), "requests": _bool})
    discovery = _section(DiscoveryConfig, d.get("discovery"), "discovery", {
        "mode": _str(choices=("static", "dns", "kubernetes")), "name": _str(nonempty=False),
        "port": _int(1, 65535), "scheme": _str(choices=("http", "https")), "models": _str_list,
        "interval_s": _num(positive=True), "api_key": _str(optional=True), "namespace": _str(optional=True),
        "port_name": _str(optional=True)})
    if discovery.mode != "static":
        if not discovery.name:
            raise ConfigError("discovery.name", f"required when discovery.mode is {discovery.mode}")
        if not discovery.models:
            raise ConfigError("discovery.models", "must list the models the discovered replicas serve")
    lifecycle = _section(LifecycleConfig, d.get("lifecycle"), "lifecycle", {
        "shutdown_grace_s": _num(lo=0), "drain_delay_s": _num(lo=0), "watch_config_s": _num(lo=0)})
    shared_load = _section(SharedLoadConfig, d.get("shared_load"), "shared_load", {
        "enabled": _bool, "url": _str(optional=True), "cluster": lambda v, k: None if v is None else _bool(v, k),
        "namespace": _str(), "interval_s": _num(positive=True), "ttl_s": _num(positive=True)})
    if shared_load.enabled and not (shared_load.url or index.url):
        raise ConfigError("shared_load.url", "required when shared_load.enabled (or set index.url)")
    if shared_load.ttl_s < 3 * shared_load.interval_s:
        raise ConfigError("shared_load.ttl_s", "must be at least 3 × shared_load.interval_s")
    return Config(listen=listen, policy=policy, models=models, index=index, replicas=tuple(replicas),
                  health=health, scrape=scrape, upstream=upstream, auth=auth, limits=limits, breaker=breaker,
                  headers=headers, logging=logging_, discovery=discovery, lifecycle=lifecycle,
                  shared_load=shared_load)


def check_policy(cfg: Config) -> None:
    """Raise ConfigError when ``policy.name`` is not a registered policy or its options fail."""
    from router.core.scheduler import default_registry

    reg = default_registry()
    if cfg.policy.name not in reg.names():
        raise ConfigError("policy.name", f"unknown policy {cfg.policy.name!r} (known: {', '.join(reg.names())})")
    try:
        reg.create(cfg.policy.name, cfg.policy.options)
    except (ValueError, TypeError) as exc:
        raise ConfigError("policy.options", str(exc)) from None
