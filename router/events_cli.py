"""``kvrouter events``: one KV-event consumer for a whole fleet, feeding the shared Redis index.

Reads the router's config file (the same one ``kvrouter serve`` uses): every replica with
``kv_events`` is followed, and its blocks are written to ``index`` (which must be Redis, so
the routers see the result). Writes are idempotent, so several consumers may run for
redundancy. Prometheus metrics (``kvrouter_kv_event_*``) are served on ``--metrics-port``.
Stops cleanly on SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import sys

from prometheus_client import CollectorRegistry, start_http_server

from router.config import ConfigError, load_config
from router.events import EventSubscriber
from router.exact_index import event_sources, exact_capacity

log = logging.getLogger("kvrouter.events")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (else a usage error, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0-65535 (0 = any free port)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0-65535, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvrouter events",
        description="Consume engine KV events (vLLM / SGLang ZMQ) into the shared Redis prefix index.")
    p.add_argument("--config", "-c", required=True, help="router config file (replicas[].kv_events, index)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set index.url=redis://127.0.0.1:6379/0 (repeatable)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the /metrics endpoint (default 127.0.0.1)")
    p.add_argument("--metrics-port", type=port_number, default=None,
                   help="port of the Prometheus /metrics endpoint (default: none)")
    p.add_argument("--replay-timeout", type=positive_float, default=2.0,
                   help="seconds to wait for each replay frame from an engine (default 2)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


async def run(config_path: str, overrides: list[str], *, metrics_host: str, metrics_port: int | None,
              replay_timeout_s: float, stop: asyncio.Event | None = None) -> int:
    from router.index.redis import RedisIndex

    cfg = load_config(config_path, dict(os.environ), overrides)
    sources = event_sources(cfg)
    if not sources:
        raise ConfigError("replicas", "no replica has kv_events: nothing to consume")
    if cfg.index.backend != "redis" or not cfg.index.url:
        raise ConfigError("index.backend", "kvrouter events writes to a shared index: set index.backend: redis "
                                           "and index.url")
    # followed replicas: the engine's evictions come as events; the bound is a backstop
    caps = {r.id: exact_capacity(r.capacity_blocks, cfg.index.capacity_blocks)
            for r in cfg.replicas if r.capacity_blocks}
    index_cls: type[RedisIndex] = RedisIndex
    if cfg.index.cluster:  # Redis Cluster (router/index/cluster.py)
        from router.index.cluster import RedisClusterIndex

        index_cls = RedisClusterIndex
    index = index_cls(cfg.index.url, namespace=cfg.index.namespace, ttl_s=cfg.index.ttl_s,
                      default_capacity=cfg.index.capacity_blocks, capacities=caps)
    registry = CollectorRegistry(auto_describe=True)
    if metrics_port is not None:
        start_http_server(metrics_port, metrics_host, registry=registry)
    sub = EventSubscriber(sources, index, registry=registry, replay_timeout_s=replay_timeout_s)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await index.start()
    await sub.start()
    log.info("kvrouter events: following %d engine(s) into %s (namespace %s)",
             len(sources), cfg.index.url.split("@")[-1], cfg.index.namespace)
    print(f"kvrouter events: following {', '.join(s.replica for s in sources)}", flush=True)
    try:
        await stop.wait()
    finally:
        await sub.close()
        await index.flush()
        await index.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(run(args.config, args.set, metrics_host=args.metrics_host,
                               metrics_port=args.metrics_port, replay_timeout_s=args.replay_timeout))
    except ConfigError as exc:
        print(f"kvrouter events: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvrouter events: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
