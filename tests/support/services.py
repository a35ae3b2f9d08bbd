"""Start real services for tests on free loopback ports, and stop only what we started.

The helpers live in :mod:`loadtest.procs` (the loadtest scripts use them too, from any
directory); this module re-exports them for the tests, unchanged: ``free_port``,
``redis_binary``, ``RedisServer``, ``http_ok``, ``Proc``, ``kvrouter_argv`` and ``ROOT``
(the repository).
"""

from __future__ import annotations

from pathlib import Path

from loadtest.procs import Proc, RedisServer, free_port, http_ok, kvrouter_argv, redis_binary

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["ROOT", "Proc", "RedisServer", "free_port", "http_ok", "kvrouter_argv", "redis_binary"]
