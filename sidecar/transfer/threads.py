"""Worker-thread copies that a cancelled pull must still wait for.

A copy into reserved slots runs in a thread so the event loop keeps serving. If the pull
is cancelled (its deadline passed), the thread cannot be stopped, and the slots must not
be freed while it still writes them: ``run_to_completion`` re-raises the cancellation only
after the thread has finished.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

__all__ = ["run_to_completion"]

T = TypeVar("T")


async def run_to_completion(
    fn: Callable[[], T], executor: concurrent.futures.Executor | None = None
) -> T:
    """``fn()`` in a worker thread; on cancellation, wait for it to end, then re-raise."""
    future = asyncio.get_running_loop().run_in_executor(executor, fn)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            try:
                await asyncio.wait([future])
            except asyncio.CancelledError:
                continue
        if not future.cancelled():
            future.exception()  # retrieved: the caller's cancellation wins
        raise
