"""The engine boundary of an in-engine storage hook: an engine calls the hook, and a bug or a
failure of ours there must never become the engine's exception."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import structlog

__all__ = ["guarded"]

T = TypeVar("T")

log = structlog.get_logger(component="adapters.storage")


def guarded(hook: str, op: str, fallback: T, fn: Callable[[], T]) -> T:
    """``fn()``, or ``fallback`` (the call's "nothing" answer) with the failure logged."""
    try:
        return fn()
    except Exception:
        log.exception("connector_call_failed", hook=hook, op=op)
        return fallback
