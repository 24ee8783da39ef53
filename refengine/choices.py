"""Several engine requests behind one answer: a batch of prompts, ``n`` samples of each.

OpenAI's choices are prompt-major: choice ``i * n + j`` is sample ``j`` of prompt ``i``.
``start`` submits them all at once (a refusal of any aborts the others); ``follow`` reports
which ones advanced, as they do, until every one has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence

from refengine.engine import Engine
from refengine.http_common import run_stream
from refengine.protocol import BadRequest
from refengine.request import Request

__all__ = ["MAX_CHOICES", "follow", "start"]

MAX_CHOICES = 64  # prompts × n in one request

Streams = list[AsyncGenerator[Request, None]]


async def _first(stream: AsyncGenerator[Request, None]) -> None:
    await anext(stream)


async def start(engine: Engine, reqs: Sequence[Request]) -> Streams:
    """Submit every request and wait for each one's first step; the first ``BadRequest``
    (capacity, a bad prompt) is raised once all of them are aborted."""
    streams = [run_stream(engine, r) for r in reqs]
    try:
        async with asyncio.TaskGroup() as tg:
            for stream in streams:
                tg.create_task(_first(stream))
    except ExceptionGroup as group:
        for stream in streams:
            await stream.aclose()
        bad = group.subgroup(BadRequest)
        while bad is not None and isinstance(bad.exceptions[0], ExceptionGroup):
            bad = bad.exceptions[0]
        if bad is not None:
            raise bad.exceptions[0] from None
        raise
    return streams


async def follow(streams: Streams, emit: Callable[[list[int]], Awaitable[bool]]) -> None:
    """Call ``emit`` with the indexes of the requests that advanced since its last call
    (all of them first), until every one has finished or ``emit`` returns False (the
    unfinished ones are then aborted)."""
    changed = set(range(len(streams)))
    running = len(streams)
    wake = asyncio.Event()

    async def pump(index: int, stream: AsyncGenerator[Request, None]) -> None:
        nonlocal running
        try:
            async with contextlib.aclosing(stream):
                async for _ in stream:
                    changed.add(index)
                    wake.set()
        finally:
            running -= 1
            wake.set()

    async with asyncio.TaskGroup() as tg:
        pumps = [tg.create_task(pump(i, s)) for i, s in enumerate(streams)]
        while changed or running:
            if not changed:
                await wake.wait()
                wake.clear()
                continue
            ready = sorted(changed)
            changed.clear()
            if not await emit(ready):
                for task in pumps:
                    task.cancel()
                return
