"""``kvrouter serve``: run the router from a config file, env overrides and CLI flags."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from router.config import Config, ConfigError, check_policy, load_config


def add_common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="listen address (listen.host)")
    p.add_argument("--port", type=int, help="listen port (listen.port)")
    p.add_argument("--policy", help="routing policy (policy.name)")
    p.add_argument("--log-format", choices=("text", "json"), help="logging.format")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="logging.level")
    p.add_argument("--no-request-log", action="store_true", help="no per-request log line (logging.requests=false)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set upstream.max_retries=3 (repeatable)")


def flag_overrides(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {}
    if args.host:
        out["listen.host"] = args.host
    if args.port is not None:
        out["listen.port"] = args.port
    if args.policy:
        out["policy.name"] = args.policy
    if args.log_format:
        out["logging.format"] = args.log_format
    if args.log_level:
        out["logging.level"] = args.log_level
    if args.no_request_log:
        out["logging.requests"] = False
    for item in args.set:
        if "=" not in item:
            raise ConfigError(item, "--set needs KEY=VALUE")
        k, v = item.split("=", 1)
        out[k.strip()] = v
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrouter serve", description="Run the kvrouter proxy. "
                                "Precedence: defaults < --config FILE < KVROUTER_* env < flags.")
    p.add_argument("--config", "-c", help="YAML config file (see config/router.yaml)")
    p.add_argument("--replica", action="append", default=[], metavar="URL=MODEL[,MODEL]",
                   help="add a replica (appended to the file's replicas), e.g. http://127.0.0.1:9001=llama")
    p.add_argument("--workers", type=int, metavar="N",
                   help="router processes on one port, supervised (listen.workers; docs/scaling.md)")
    add_common_flags(p)
    args = p.parse_args(argv)
    if args.workers is not None:
        args.set.append(f"listen.workers={args.workers}")

    def load() -> Config:  # also the SIGHUP reload (router/lifecycle.py): same sources again
        cfg = load_config(args.config, env=os.environ, overrides=flag_overrides(args))
        cfg = with_cli_replicas(cfg, args.replica)
        check_policy(cfg)
        if not cfg.replicas and cfg.discovery.mode == "static":
            raise ConfigError("replicas", "at least one replica is required (or set discovery.mode)")
        return cfg

    try:
        cfg = load()
    except ConfigError as exc:
        print(f"kvrouter serve: config error: {exc}", file=sys.stderr)
        return 2
    if cfg.listen.workers > 1:
        from router.workers import supervise

        return supervise(cfg, list(sys.argv[1:] if argv is None else argv))
    return run_router(cfg, loader=load, watch_path=args.config)


def with_cli_replicas(cfg: Config, specs: list[str]) -> Config:
    if not specs:
        return cfg
    data = cfg.to_dict()
    n = len(data["replicas"])
    for i, spec in enumerate(specs):
        url, _, models = spec.partition("=")
        if not models:
            raise ConfigError(f"--replica {spec}", "must be URL=MODEL[,MODEL]")
        data["replicas"].append({"id": f"r{n + i}", "url": url, "models": models.split(",")})
    return Config.from_dict(data)


def run_router(cfg: Config, banner: Callable[[str], str] | None = None,
               loader: Callable[[], Config] | None = None, watch_path: str | None = None) -> int:
    """Serve ``cfg`` until SIGINT/SIGTERM (then drain, exit 0); prints ``banner(url)`` (or the
    URL) once listening; SIGHUP reloads through ``loader`` (see router/lifecycle.py)."""
    from router.logs import setup_logging
    from router.server import Server, run, serve_forever

    logger = setup_logging(cfg.logging)

    def ready(server: Server) -> None:
        logger.info("kvrouter listening on %s (policy %s, %d replicas)", server.url, cfg.policy.name,
                    len(cfg.replicas))
        print(banner(server.url) if banner else f"kvrouter listening on {server.url}", flush=True)

    try:
        run(lambda: serve_forever(cfg, on_ready=ready, loader=loader, watch_path=watch_path))
    except OSError as exc:
        print(f"kvrouter serve: {exc}", file=sys.stderr)
        return 1
    return 0
