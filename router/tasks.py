"""Background-task helper shared by the router's long-lived components (and the simulator's
KV-event publisher): stop a task and wait until it has stopped."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (if any) and wait for it to end; whatever it raised on the way out is
    dropped (its own loop logs failures while it runs)."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
