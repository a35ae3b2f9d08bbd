"""The ``kvrouter`` command: a thin dispatcher to each subcommand's own module.

Each subcommand lives with the code it drives and exposes ``main(argv) -> int``; this file
only maps names to modules (imported lazily, so ``kvrouter plan`` never loads aiohttp).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

# name -> (module, one-line help). Add a line when a subcommand lands.
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("backends.plan_cli", "capacity planner: memory, KV cache, throughput, concurrency"),
    "sim": ("backends.sim.cli", "run one simulated vLLM-compatible GPU engine"),
    "serve": ("router.serve_cli", "run the router from a config file"),
    "up": ("router.up_cli", "router + simulated engines in one command (embedded default)"),
    "config": ("router.config_cli", "config tools: `kvrouter config check FILE`"),
    "replay": ("loadtest.replay_cli", "replay a trace live (--target URL) or offline (--offline)"),
    "trace": ("loadtest.trace_cli", "trace tools: `kvrouter trace stats FILE`"),
    "events": ("router.events_cli", "consume engine KV events into the shared index"),
}


def _usage() -> str:
    lines = ["usage: kvrouter COMMAND [options]   (kvrouter COMMAND --help for each)", "", "commands:"]
    for name, (mod, text) in COMMANDS.items():
        if _available(mod):
            lines.append(f"  {name:<8} {text}")
    return "\n".join(lines)


def _available(mod: str) -> bool:
    return importlib.util.find_spec(mod.rsplit(".", 1)[0]) is not None and _spec(mod)


def _spec(mod: str) -> bool:
    try:
        return importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        return False


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] == "--version":
        from router import __version__

        print(f"kvrouter {__version__}")
        return 0
    name = args[0]
    if name not in COMMANDS or not _available(COMMANDS[name][0]):
        print(f"kvrouter: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
