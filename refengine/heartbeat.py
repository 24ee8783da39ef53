"""The step loop's heartbeat: what ``/health`` answers from.

SGLang's ``/health`` sends a one-token generation, but counts *any* output of the scheduler
after the probe began as healthy, and its scheduler drops the probe while a batch runs: a
busy engine is healthy because it makes progress, not because a probe got through its
queue. Our engine's loop beats once per pass (a step run, or requests admitted or finished);
``/health`` waits for the next beat while the engine has work, and sends the one-token
generation only when it is idle (nothing else would make the loop run). A loop that stopped
(its task ended) or stalls inside a step never beats, and the probe times out: unhealthy.
"""

from __future__ import annotations

import asyncio

__all__ = ["Heartbeat"]


class Heartbeat:
    """Counts the loop's passes and wakes whoever waits for the next one."""

    def __init__(self) -> None:
        self.beats = 0
        self._waiters: list[asyncio.Future[None]] = []

    def beat(self) -> None:
        """The loop completed a pass."""
        self.beats += 1
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def next(self) -> None:
        """Until the next beat (cancel it to stop waiting)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter.cancelled() and waiter in self._waiters:  # gave up: forget it
                self._waiters.remove(waiter)
