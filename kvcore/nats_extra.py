"""The ``nats`` extra (nats-py), loaded on first use: only a gateway given ``--nats`` and a
sidecar given ``--events-via nats`` need it; and the one way they connect and close."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Awaitable, Callable
from functools import cache
from typing import Any
from urllib.parse import urlsplit

from kvcore.extras import MissingExtraError

__all__ = ["check_url", "close_quietly", "connect", "load"]


@cache
def _module() -> Any:
    return importlib.import_module("nats")


def load(command: str) -> Any:
    """The ``nats`` module, or ``MissingExtraError`` naming the extra ``command`` needs."""
    try:
        return _module()
    except ImportError as exc:
        raise MissingExtraError(command, "nats", "nats-py", exc) from exc


def check_url(url: str) -> None:
    """``ValueError`` unless ``url`` (a gateway's or a sidecar's ``--nats``) names NATS
    servers as ``connect`` takes them: nats:// or tls://HOST:PORT, comma-separated for a
    cluster."""
    for server in url.split(","):
        parts = urlsplit(server.strip())
        if parts.scheme not in ("nats", "tls") or not parts.hostname:
            raise ValueError("--nats must be nats://HOST:PORT (or tls://, comma-separated for a "
                             f"cluster), got {url!r}")


_RECONNECT_WAIT_S = 0.5
_CONNECT_TIMEOUT_S = 2
_CLOSE_TIMEOUT_S = 2.0


async def connect(nc: Any, url: str, name: str, *, error_cb: Callable[[Exception], Awaitable[None]],
                  disconnected_cb: Callable[[], Awaitable[None]],
                  reconnected_cb: Callable[[], Awaitable[None]]) -> None:
    """Connect ``nc`` the way every NATS user here does: reconnecting for ever, every
    half second, and saying so through the callbacks."""
    await nc.connect(
        url,
        name=name,
        allow_reconnect=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=_RECONNECT_WAIT_S,
        connect_timeout=_CONNECT_TIMEOUT_S,
        error_cb=error_cb,
        disconnected_cb=disconnected_cb,
        reconnected_cb=reconnected_cb,
    )


async def close_quietly(nats: Any, nc: Any, log: Any) -> None:
    """Close ``nc`` within two seconds; a failure is logged, never raised (shutting down)."""
    try:
        async with asyncio.timeout(_CLOSE_TIMEOUT_S):
            await nc.close()
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        log.warning("nats_close_failed", error=repr(exc))
