"""``kvrouter up``: the embedded default in one command.

Starts N simulated engines (``kvrouter sim``) as child processes on free loopback ports,
waits until each answers ``/health``, learns the served model from ``/v1/models``, then
runs the router in this process with in-memory state (no Redis). Prints the endpoint and a
``curl`` and an ``openai`` example. Ctrl-C (or SIGTERM) stops the router and every child
it started, by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from router.config import ConfigError, check_policy, load_config
from router.serve_cli import add_common_flags, flag_overrides


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class SimFleet:
    """The simulated engines ``kvrouter up`` owns (children, ended by PID)."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)

    def start(self, arg_lists: list[list[str]], host: str = "127.0.0.1", timeout: float = 60.0) -> None:
        """One engine per argument list; returns when every one answers ``/health``."""
        for sim_args in arg_lists:
            port = free_port(host)
            argv = [sys.executable, "-m", "router.cli", "sim", "--host", host, "--port", str(port), *sim_args]
            self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True))
            self.urls.append(f"http://{host}:{port}")
        deadline = time.monotonic() + timeout
        for proc, url in zip(self.procs, self.urls, strict=True):
            while not _http_ok(url + "/health"):
                if proc.poll() is not None:
                    raise RuntimeError(f"simulated engine {url} exited with code {proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"simulated engine {url} not healthy after {timeout:.0f}s")
                time.sleep(0.05)

    def served_model(self) -> str:
        with urllib.request.urlopen(self.urls[0] + "/v1/models", timeout=5) as r:
            data = json.loads(r.read())
        return str(data["data"][0]["id"])

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as r:
            return 200 <= r.status < 300
    except Exception:
        return False


def banner(url: str, model: str, policy: str, sims: list[str]) -> str:
    body = json.dumps({"model": model, "prompt": "Hello, my name is", "max_tokens": 16})
    py = ("from openai import OpenAI; "
          f"c = OpenAI(base_url='{url}/v1', api_key='none'); "
          f"print(c.completions.create(model='{model}', prompt='Hello, my name is', max_tokens=16).choices[0].text)")
    return "\n".join([
        f"kvrouter up: router on {url}  (policy {policy}; model {model}; "
        f"{len(sims)} simulated engines: {', '.join(sims)})",
        "",
        "try it:",
        f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'",
        f'  python -c "{py}"',
        "",
        f"metrics: {url}/metrics   ready: {url}/ready   Ctrl-C stops everything.",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrouter up", description="Router plus N simulated engines on this "
                                "machine (in-memory state, no Redis). Ctrl-C stops everything.")
    p.add_argument("--config", "-c", help="router YAML config (its replicas are ignored; the sims replace them)")
    p.add_argument("--replicas", "-n", type=int, default=2, help="number of simulated engines (default 2)")
    p.add_argument("--model", help="model the sims serve (passed to `kvrouter sim --model`; default: the sim's)")
    p.add_argument("--time-scale", type=float, help="sim --time-scale (e.g. 0.01 runs 100x faster than real time)")
    p.add_argument("--num-blocks", type=int, help="sim --num-blocks (KV blocks per engine)")
    p.add_argument("--block-size", type=int, help="sim --block-size (tokens per KV block)")
    p.add_argument("--seed", type=int, default=0, help="sim --seed (engine i gets seed + i); default 0")
    p.add_argument("--sim-args", default="", help="extra arguments for every `kvrouter sim`, one quoted string")
    add_common_flags(p)
    args = p.parse_args(argv)
    if args.replicas < 1:
        print("kvrouter up: --replicas must be >= 1", file=sys.stderr)
        return 2
    overrides = flag_overrides(args)
    try:
        base = load_config(args.config, env=os.environ, overrides=overrides)
        check_policy(base)
    except ConfigError as exc:
        print(f"kvrouter up: config error: {exc}", file=sys.stderr)
        return 2
    if base.listen.port and not _port_free(base.listen.host, base.listen.port):
        print(f"kvrouter up: {base.listen.host}:{base.listen.port} is in use (choose another with --port)",
              file=sys.stderr)
        return 1
    return _run(args, base, SimFleet())


def _sim_args(args: argparse.Namespace, i: int) -> list[str]:
    out: list[str] = []
    if args.model:
        out += ["--model", args.model]
    if args.time_scale is not None:
        out += ["--time-scale", str(args.time_scale)]
    if args.num_blocks is not None:
        out += ["--num-blocks", str(args.num_blocks)]
    if args.block_size is not None:
        out += ["--block-size", str(args.block_size)]
    out += ["--seed", str(args.seed + i)]
    return out + shlex.split(args.sim_args)


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _run(args: argparse.Namespace, base: Any, fleet: SimFleet) -> int:
    from router.config import Config
    from router.serve_cli import run_router

    try:
        fleet.start([_sim_args(args, i) for i in range(args.replicas)])
        model = fleet.served_model()
        data = base.to_dict()
        data["replicas"] = [{"id": f"sim{i}", "url": u, "models": [model]} for i, u in enumerate(fleet.urls)]
        if args.block_size and model not in data["models"]:
            data["models"][model] = {"block_size": args.block_size}
        cfg = Config.from_dict(data)
        return run_router(cfg, banner=lambda url: banner(url, model, cfg.policy.name, fleet.urls))
    except (RuntimeError, OSError, ConfigError) as exc:
        print(f"kvrouter up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        fleet.stop()
