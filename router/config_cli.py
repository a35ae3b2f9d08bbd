"""``kvrouter config check FILE`` (validate) and ``kvrouter config show FILE`` (effective config).

Both apply ``KVROUTER_...`` environment overrides (unless ``--no-env``) and ``--set``
overrides exactly as ``kvrouter serve`` does, so what passes here starts there. Exit code 0
when valid, 1 when invalid (the message names the key), 2 on usage errors.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

import yaml

from router.config import Config, ConfigError, check_policy, load_config

_SECRET_KEYS = {"api_key", "admin_key", "api_keys"}
# query parameters of a URL whose value is a secret (e.g. redis://host/0?password=...)
_SECRET_PARAMS = ("password", "pass", "passwd", "token", "secret", "key", "api_key", "apikey")
_URL_USERINFO = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@?#:]*)(?::[^/?#]*)?@")
_URL_PARAM = re.compile(r"(?P<head>[?&](?:" + "|".join(_SECRET_PARAMS) + r")=)[^&#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """A URL with its password (``user:PASSWORD@``) and secret query parameters as ``***``;
    any other string unchanged. ``redis://u:pw@a:1,b:2/0`` → ``redis://u:***@a:1,b:2/0``."""
    if "://" not in url:
        return url
    m = _URL_USERINFO.match(url)
    if m is not None and ":" in url[len(m.group("head")):m.end()]:
        url = f"{m.group('head')}{m.group('user')}:***@{url[m.end():]}"
    return _URL_PARAM.sub(lambda p: p.group("head") + "***", url)


def _masked(d: Any) -> Any:
    """Secrets masked: the values of secret keys, and passwords inside every URL string."""
    if isinstance(d, dict):
        return {k: ("***" if k in _SECRET_KEYS and v else _masked(v)) for k, v in d.items()}
    if isinstance(d, list):
        return [_masked(x) for x in d]
    if isinstance(d, str):
        return redact_url(d)
    return d


def _load(args: argparse.Namespace) -> Config:
    overrides: dict[str, str] = {}
    for item in args.set:
        if "=" not in item:
            raise ConfigError(item, "--set needs KEY=VALUE")
        k, v = item.split("=", 1)
        overrides[k.strip()] = v
    cfg = load_config(args.file, env=None if args.no_env else os.environ, overrides=overrides)
    check_policy(cfg)
    if not cfg.replicas and not args.allow_empty:
        raise ConfigError("replicas", "at least one replica is required (kvrouter up supplies its own)")
    return cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrouter config", description="Config tools.")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, text in (("check", "validate a router config file"),
                       ("show", "print the effective config (file + env + --set), secrets masked")):
        sp = sub.add_parser(name, help=text, description=text)
        sp.add_argument("file", help="YAML config file")
        sp.add_argument("--no-env", action="store_true", help="ignore KVROUTER_* environment overrides")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key")
        sp.add_argument("--allow-empty", action="store_true", help="accept a config without replicas")
    args = p.parse_args(argv)
    try:
        cfg = _load(args)
    except ConfigError as exc:
        where = "environment" if getattr(exc, "source", None) else args.file  # a KVROUTER_* variable
        print(f"{where}: invalid: {exc}", file=sys.stderr)
        return 1
    if args.cmd == "show":
        print(yaml.safe_dump(_masked(cfg.to_dict()), sort_keys=False), end="")
        return 0
    models = cfg.model_names()
    print(f"{args.file}: ok — policy {cfg.policy.name}, {len(cfg.replicas)} replica(s), "
          f"model(s) {', '.join(models) or '-'}, listen {cfg.listen.host}:{cfg.listen.port}, "
          f"index {cfg.index.backend}")
    return 0
