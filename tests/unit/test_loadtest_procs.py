"""The loadtest scripts do not depend on the (uninstalled) ``tests`` package: their process,
Redis and sim helpers live in ``loadtest.procs``, which ``tests/support`` re-exports."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import loadtest.procs as procs
from tests.support import services, sim

LOADTEST = Path(__file__).resolve().parents[2] / "loadtest"


def test_no_loadtest_module_imports_tests():
    offenders = [p.name for p in LOADTEST.rglob("*.py")
                 if re.search(r"^\s*(from|import) tests\b", p.read_text(), re.M)]
    assert offenders == []


def test_scripts_import_from_another_directory(tmp_path):
    code = ("import loadtest.chaos, loadtest.hitrate_demo, loadtest.bench_routing, loadtest.bench_scale\n"
            "from loadtest.procs import RedisServer, SimHandle, start_sims, stop_sims\n"
            "import importlib.util; assert importlib.util.find_spec('tests') is None, 'tests importable'\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_tests_support_reexports_the_same_objects():
    assert services.RedisServer is procs.RedisServer and services.Proc is procs.Proc
    assert services.free_port is procs.free_port and sim.SimHandle is procs.SimHandle
    assert sim.start_sims is procs.start_sims and services.ROOT == procs.ROOT
