"""Two ``kvrouter sim`` engines publishing KV events over ZMQ (one per payload encoding,
``map`` and ``array``), each on its own ``ipc://`` publisher and replay endpoints in a fresh
temporary directory, for the integration tests of exact (event-following) routing::

    @pytest.fixture
    def fleet():
        yield from kv_event_fleet("sim-model", 16, 64, "kvr-x-")

yields ``(sims, kv)``: the started :class:`~loadtest.procs.SimHandle` s and, per sim, its
``{"endpoint", "replay_endpoint", "topic"}`` (a replica's ``kv_events`` config); every sim is
stopped afterwards.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

from loadtest.procs import SimHandle, stop_sims


def kv_event_fleet(model: str, block_size: int, num_blocks: int,
                   prefix: str) -> Iterator[tuple[list[SimHandle], list[dict[str, str]]]]:
    sims, kv = [], []
    for enc in ("map", "array"):
        d = Path(tempfile.mkdtemp(prefix=prefix))
        ev = {"endpoint": f"ipc://{d}/pub", "replay_endpoint": f"ipc://{d}/replay", "topic": ""}
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "encoding": enc, **ev}
        sims.append(SimHandle(model=model, block_size=block_size, num_blocks=num_blocks,
                              kv_events_config=json.dumps(cfg)))
        kv.append(ev)
    try:
        for s in sims:
            s.launch()
        for s in sims:
            s.wait_ready()
        yield sims, kv
    finally:
        stop_sims(sims)
