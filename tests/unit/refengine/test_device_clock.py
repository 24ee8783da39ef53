"""The simulated device's clock: waits end at their deadline, never before it, on a timerfd
where Linux has one (how precise it is, the goodput bench's ITL shows: no timed asserts)."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from refengine.device_clock import DeviceClock


def test_linux_waits_on_a_timerfd() -> None:
    clock = DeviceClock()
    assert sys.platform.startswith("linux"), "the engine's images and CI are Linux"
    assert clock.precise
    clock.close()
    assert not clock.precise


@pytest.mark.parametrize("precise", [True, False])
def test_a_wait_never_ends_before_its_deadline(precise: bool) -> None:
    clock = DeviceClock()
    if not precise:
        clock.close()  # asyncio's own sleep, as where no timerfd can be made

    async def waits() -> list[float]:
        early = []
        for delay in (0.0, -0.001, 0.0003, 0.002, 0.0001):
            deadline = time.monotonic() + delay
            await clock.sleep_until(deadline)
            early.append(deadline - time.monotonic())
        return early

    assert all(e <= 0 for e in asyncio.run(waits()))
    clock.close()


def test_a_cancelled_wait_leaves_no_expiry_behind() -> None:
    """A wait cancelled before its timer fires disarms it: the next wait, to a later
    deadline, is not woken by the stale one."""
    clock = DeviceClock()

    async def scenario() -> float:
        stale = asyncio.create_task(clock.sleep_until(time.monotonic() + 0.005))
        await asyncio.sleep(0)  # the timer is armed and watched
        stale.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stale
        await asyncio.sleep(0.01)  # past the stale deadline
        deadline = time.monotonic() + 0.02
        await clock.sleep_until(deadline)
        return deadline - time.monotonic()

    assert asyncio.run(scenario()) <= 0
    clock.close()


def test_waits_run_beside_other_tasks() -> None:
    """The loop keeps serving other work while a device waits."""
    clock = DeviceClock()
    ticks = 0

    async def ticker(stop: asyncio.Event) -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(ticker(stop))
        await clock.sleep_until(time.monotonic() + 0.01)
        stop.set()
        await task

    asyncio.run(scenario())
    assert ticks > 1
    clock.close()
