"""Waiting for a condition in tests: poll it until a deadline, never sleep a fixed time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["wait_for", "wait_until"]


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Poll ``predicate`` until it holds; ``AssertionError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


async def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """``wait_until`` on the event loop, polling finely (some windows last milliseconds)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.0002)
