"""Waiting for a condition in tests: poll it until a deadline, never sleep a fixed time.

Every wait here takes a ``check`` and calls it until it returns something truthy, which the
wait returns. A check that is not there yet returns something falsy or fails an
``assert``: it is called again after ``interval_s``, and once ``timeout_s`` has passed the
wait raises ``AssertionError`` naming ``what``, chained to the check's last failed assert
(so an assert in a check keeps its message: the state it saw last). Any other exception
from the check ends the wait at once (a process that exited, say).

- ``wait_until``: from plain code (a test thread, a helper that blocks).
- ``wait_for``: on the event loop, polling finely (an in-process window can last
  milliseconds).
- ``eventually``: on the event loop, coarsely, for what another process or a server brings
  about; its check may be a coroutine function (an HTTP probe).
- ``wait_http_ok`` / ``wait_http_ok_async``: until a URL answers 200.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast, overload

import aiohttp

__all__ = [
    "eventually",
    "http_ok",
    "wait_for",
    "wait_http_ok",
    "wait_http_ok_async",
    "wait_until",
]

T = TypeVar("T")


class _Deadline:
    """One wait's clock: whether to try again, and the error once the time is up."""

    def __init__(self, what: str, timeout_s: float) -> None:
        self.what = what
        self.timeout_s = timeout_s
        self.end = time.monotonic() + timeout_s
        self.last_failure: AssertionError | None = None

    def check_time(self) -> None:
        if time.monotonic() > self.end:
            raise AssertionError(
                f"timed out after {self.timeout_s:g}s waiting for {self.what}"
            ) from self.last_failure


def wait_until(
    check: Callable[[], T], what: str, timeout_s: float = 20.0, interval_s: float = 0.02
) -> T:
    """Call ``check`` until it returns something truthy and return that (module docstring)."""
    deadline = _Deadline(what, timeout_s)
    while True:
        try:
            if result := check():
                return result
        except AssertionError as exc:
            deadline.last_failure = exc
        deadline.check_time()
        time.sleep(interval_s)


async def _wait(
    check: Callable[[], T | Awaitable[T]], what: str, timeout_s: float, interval_s: float
) -> T:
    deadline = _Deadline(what, timeout_s)
    while True:
        try:
            result = check()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return cast(T, result)
        except AssertionError as exc:
            deadline.last_failure = exc
        deadline.check_time()
        await asyncio.sleep(interval_s)


async def wait_for(
    check: Callable[[], T], what: str, timeout_s: float = 20.0, interval_s: float = 0.0002
) -> T:
    """``wait_until`` on the event loop, polling finely (some windows last milliseconds)."""
    return await _wait(check, what, timeout_s, interval_s)


@overload
async def eventually(
    check: Callable[[], Awaitable[T]],
    what: str,
    timeout_s: float = 20.0,
    interval_s: float = 0.02,
) -> T: ...


@overload
async def eventually(
    check: Callable[[], T],
    what: str,
    timeout_s: float = 20.0,
    interval_s: float = 0.02,
) -> T: ...


async def eventually(
    check: Callable[[], T | Awaitable[T]],
    what: str,
    timeout_s: float = 20.0,
    interval_s: float = 0.02,
) -> T:
    """``wait_for`` at a coarser pace, for what other processes or servers bring about.

    ``check`` may be a plain function or a coroutine function.
    """
    return await _wait(check, what, timeout_s, interval_s)


def http_ok(url: str, timeout_s: float = 5.0) -> bool:
    """Whether ``GET url`` answers 200 now (a refused connection or an error status is no)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def wait_http_ok(url: str, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``GET url`` until it answers 200."""
    wait_until(lambda: http_ok(url), what, timeout_s, interval_s=0.05)


async def wait_http_ok_async(
    session: aiohttp.ClientSession, url: str, what: str, timeout_s: float = 60.0
) -> None:
    """Poll ``GET url`` with ``session`` until it answers 200."""

    async def ok() -> bool:
        try:
            async with session.get(url) as resp:
                return resp.status == 200
        except aiohttp.ClientConnectionError:
            return False

    await eventually(ok, what, timeout_s, interval_s=0.05)
