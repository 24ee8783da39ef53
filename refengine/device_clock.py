"""Waking at a simulated step's end to the microsecond, not the millisecond.

asyncio waits in ``epoll_wait``, whose timeout is whole milliseconds, rounded up
(``selectors.EpollSelector``): a coroutine that sleeps to a step's end wakes up to 1 ms late.
A simulated device lays its steps out on its own timeline, so the lateness does not add up,
but each step's tokens leave between 0 and 1 ms late, and the gaps a client sees spread by
±1 ms around steps whose durations differ by tenths of one (the flood load's steps last
~8.6 ms). Dynamo's mocker wakes on a ``timerfd`` (``sleep_until_precise``); :class:`DeviceClock`
does the same on Linux: an absolute ``CLOCK_MONOTONIC`` timer whose file descriptor the event
loop watches, so ``epoll`` returns when it fires. Elsewhere, or when the timer cannot be made,
it sleeps as asyncio does.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import sys
import time

__all__ = ["DeviceClock"]

_CLOCK_MONOTONIC = 1  # time.monotonic's clock on Linux
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int,
                                         ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return libc


class DeviceClock:
    """Sleeps to absolute ``time.monotonic()`` deadlines, to the microsecond where the
    platform allows. One per simulated device: its waits never overlap."""

    def __init__(self) -> None:
        self._libc = _libc()
        self._fd = -1
        if self._libc is not None:
            self._fd = self._libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)

    @property
    def precise(self) -> bool:
        """Whether waits end when the deadline passes (a timerfd), not up to 1 ms after."""
        return self._fd >= 0

    async def sleep_until(self, deadline: float) -> None:
        """Return once ``time.monotonic()`` has reached ``deadline``."""
        delay = deadline - time.monotonic()
        if delay <= 0:
            await asyncio.sleep(0)  # a step that took no time still lets others run
            return
        if not self._arm(deadline):
            await asyncio.sleep(delay)
            return
        loop = asyncio.get_running_loop()
        fired: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not fired.done():
                fired.set_result(None)

        loop.add_reader(self._fd, wake)
        try:
            await fired
        finally:
            loop.remove_reader(self._fd)
            self._drain()

    def _arm(self, deadline: float) -> bool:
        if self._libc is None or self._fd < 0:
            return False
        sec = int(deadline)
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(sec, int((deadline - sec) * 1e9)))
        done: int = self._libc.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME,
                                               ctypes.byref(spec), None)
        return done == 0

    def _drain(self) -> None:
        """Read the expiry count, so the fd is not readable at the next wait; a wait
        cancelled before its timer fired disarms it instead."""
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            assert self._libc is not None
            off = _Itimerspec(_Timespec(0, 0), _Timespec(0, 0))
            self._libc.timerfd_settime(self._fd, 0, ctypes.byref(off), None)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
