"""The docs match the code: every config key is in the documented example config and in
the docs, every CLI command is in the README, every router metric is documented."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from router.cli import COMMANDS
from router.config import Config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = (ROOT / "config" / "router.yaml").read_text()
DOCS = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
README = (ROOT / "README.md").read_text()


def _walk(cls: type, prefix: str = "") -> typing.Iterator[str]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        yield path
        for arg in typing.get_args(hints[f.name]) or (hints[f.name],):
            for inner in typing.get_args(arg) or (arg,):
                if dataclasses.is_dataclass(inner):
                    yield from _walk(inner, path + ".")


KEYS = list(_walk(Config))


def _section(text: str, name: str) -> str:
    m = re.search(rf"^{name}:.*?(?=^\S|\Z)", text, re.M | re.S)
    assert m, f"section {name!r} missing from config/router.yaml"
    return m.group(0)


@pytest.mark.parametrize("key", [k for k in KEYS if "." in k])
def test_every_config_key_is_in_the_example_config(key: str) -> None:
    section, *rest = key.split(".")
    leaf = rest[-1]
    assert re.search(rf"\b{leaf}:", _section(EXAMPLE, section)), f"{key} is not in config/router.yaml"


def _documented(key: str) -> bool:
    """`a.b.c` itself, `a.b`, `.c` on a line naming section `a`, or a `c` table row in a doc
    about section `a` (or its sub-section `b`)."""
    parts = key.split(".")
    section, leaf = parts[0], parts[-1]
    if f"`{key}`" in DOCS:
        return True
    for ln in DOCS.splitlines():
        if f"`{section}" in ln and (f".{leaf}`" in ln or f"`{leaf}`" in ln):
            return True
    for doc in (ROOT / "docs").glob("*.md"):
        text = doc.read_text()
        about = any(f"`{p}" in text or f"{p}:" in text for p in parts[:-1])
        if about and re.search(rf"^\| `{leaf}` \|", text, re.M):
            return True
    return False


@pytest.mark.parametrize("key", KEYS)
def test_every_config_key_is_documented(key: str) -> None:
    assert _documented(key), f"{key} is not in docs/"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_is_in_the_readme(command: str) -> None:
    assert f"`kvrouter {command}" in README


def test_every_router_metric_is_documented() -> None:
    names: set[str] = set()
    for path in list((ROOT / "router").rglob("*.py")) + list((ROOT / "backends").rglob("*.py")):
        names |= set(re.findall(r"[\"'](kvrouter_[a-z0-9_]+)[\"']", path.read_text()))
    assert len(names) > 20  # the scan found the metrics
    missing = sorted(n for n in names if n not in DOCS and n not in README)
    assert not missing, f"metrics without docs: {missing}"
