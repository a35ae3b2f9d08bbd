"""Start and stop ``kvrouter sim`` processes on free loopback ports, for integration tests
(the helpers live in :mod:`loadtest.procs` and are re-exported here; the fixtures are here).

    sims = start_sims(3, time_scale=0, num_blocks=512)   # all started in parallel
    sims[0].url        # "http://127.0.0.1:PORT"
    sims[0].kill(); sims[0].restart()                     # same port again
    stop_sims(sims)

Keyword flags map to CLI options: ``num_blocks=512`` → ``--num-blocks 512``,
``no_prefix_caching=True`` → ``--no-prefix-caching`` (False/None omit the flag). The
``sim_factory`` fixture starts sims and stops every one of them when the test ends::

    def test_x(sim_factory):
        a, b = sim_factory(2, time_scale=0)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from loadtest.procs import DEFAULT_FLAGS, SimHandle, sim_argv, start_sims, stop_sims

__all__ = ["DEFAULT_FLAGS", "SimHandle", "sim_argv", "start_sims", "stop_sims", "sim_factory",
           "sim_factory_module"]


def _factory() -> Iterator[Any]:
    started: list[SimHandle] = []

    def factory(n: int = 1, **flags: Any) -> list[SimHandle]:
        sims = start_sims(n, **flags)
        started.extend(sims)
        return sims

    try:
        yield factory
    finally:
        stop_sims(started)


@pytest.fixture
def sim_factory() -> Iterator[Any]:
    """``sim_factory(n, **flags) -> list[SimHandle]``; every sim started is stopped at teardown."""
    yield from _factory()


@pytest.fixture(scope="module")
def sim_factory_module() -> Iterator[Any]:
    """Like ``sim_factory``, but the sims live for the whole test module (cheaper)."""
    yield from _factory()
