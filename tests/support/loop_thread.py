"""An event loop in a background thread: in-process servers for tests, which keep serving
whatever the test's own loop (or its blocking calls) is doing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")
_TIMEOUT_S = 60.0


class LoopThread:
    """``start()`` runs a loop (``loop_factory``'s, else asyncio's) in a daemon thread until
    ``close()``, which cancels what is left on it; ``run(coro)`` waits for a coroutine there."""

    def __init__(self, name: str,
                 loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> None:
        self._factory = loop_factory
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        async def until_closed() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._started.set()
            await self._stop.wait()

        # the runner cancels the tasks still running and closes the loop on leaving
        with asyncio.Runner(loop_factory=self._factory) as runner:
            runner.run(until_closed())

    def start(self) -> LoopThread:
        self._thread.start()
        if not self._started.wait(_TIMEOUT_S):
            raise TimeoutError(f"{self._thread.name}: its event loop did not start")
        return self

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = _TIMEOUT_S) -> T:
        """``coro``'s result, run on the thread's loop."""
        assert self._loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def close(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(_TIMEOUT_S)
        if self._thread.is_alive():
            raise TimeoutError(f"{self._thread.name}: its event loop did not stop")
