"""The normalized event stream every adapter hands the sidecar, and the tasks that feed it.

``AdapterEventQueue`` owns the consumer tasks of one adapter (one per DP rank or poller) in
an ``asyncio.TaskGroup`` and a bounded queue between them and ``events()``. Overflow policy:
producers ``await put`` (backpressure); the engine side then buffers (ZMQ high-water mark,
TensorRT-LLM's event queue) and what it drops comes back as a gap the adapter resyncs from,
so nothing is dropped silently here.

A producer that crashes ends the stream with its exception (``events()`` re-raises it), so
the sidecar sees a broken adapter instead of a silent one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from kvcore.events import KVEvent

__all__ = ["AdapterEventQueue"]

_END = object()


class AdapterEventQueue:
    """A bounded queue of canonical events plus the tasks producing them (what the sidecar
    then serves to subscribers is ``sidecar.event_stream.EventStream``)."""

    def __init__(self, maxsize: int) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=maxsize)
        self._group: asyncio.TaskGroup | None = None
        self._runner: asyncio.Task[None] | None = None
        self._factories: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._error: BaseException | None = None
        self._closed = False

    async def put(self, events: list[KVEvent]) -> None:
        for event in events:
            await self._queue.put(event)

    def start(self, producers: list[Callable[[], Coroutine[Any, Any, None]]]) -> None:
        """Run ``producers`` until ``aclose()`` (or the first one that fails)."""
        if self._runner is not None:
            raise RuntimeError("the event stream is already running")
        self._factories = producers
        self._runner = asyncio.create_task(self._run(), name="kv-event-producers")

    async def _run(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                for make in self._factories:
                    group.create_task(make())
        except BaseExceptionGroup as eg:  # a producer failed: end the stream with it
            self._error = eg.exceptions[0] if len(eg.exceptions) == 1 else eg
        finally:
            # Wake a waiting consumer even when the queue is full.
            while True:
                try:
                    self._queue.put_nowait(_END)
                    break
                except asyncio.QueueFull:
                    self._queue.get_nowait()

    async def __aiter__(self) -> AsyncIterator[KVEvent]:
        while True:
            item = await self._queue.get()
            if item is _END:
                self._queue.put_nowait(_END)  # every later iterator ends too
                if self._error is not None and not self._closed:
                    raise self._error
                return
            yield item

    def get_nowait(self) -> KVEvent | None:
        """One queued event, or None when none is waiting (for tests and benchmarks)."""
        try:
            item = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None
        if item is _END:
            self._queue.put_nowait(_END)
            return None
        return item  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        self._closed = True
        runner, self._runner = self._runner, None
        if runner is not None and not runner.done():
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner
