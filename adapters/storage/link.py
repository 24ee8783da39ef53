"""A block store client that an engine hook can lean on: reconnects, counts, never raises.

``StoreLink.call(op, fn, fallback)`` runs ``fn(client)`` against a connected
``shm.BlockStoreClient``. When the owner's socket is missing, the owner went away, the
store refused the request or anything else failed, it logs the failure, counts it, and
returns ``fallback`` (the caller's "miss" answer); the engine keeps serving from its own
cache. A lost connection is retried lazily, at most once per ``retry_interval_s``, so an
engine whose sidecar restarts picks the store up again without a restart of its own.

``check`` runs once on every new connection (geometry: block bytes, dtype, layout); a
``StoreMismatchError`` from it keeps the link down and is logged as ``store_mismatched``
(``connect(strict=True)`` raises it instead, for a fail-fast check at engine start-up).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import structlog

from shm import BlockStoreClient, BlockStoreError, ClientDetachedError

__all__ = ["HookCounters", "StoreLink", "StoreMismatchError"]

R = TypeVar("R")

log = structlog.get_logger(component="adapters.storage")


class StoreMismatchError(ValueError):
    """The store's blocks do not fit the engine's pages (size, dtype or layout)."""


@dataclass(slots=True)
class HookCounters:
    """What one hook did, since it was built (read with ``snapshot()``)."""

    blocks_stored: int = 0  # blocks copied into the store
    blocks_present: int = 0  # blocks a put found already held (nothing copied)
    blocks_loaded: int = 0  # blocks copied out of the store into the engine
    blocks_missed: int = 0  # blocks asked for that the store did not hold
    calls_failed: int = 0  # calls answered as misses because the store failed
    calls_unavailable: int = 0  # calls answered as misses while the store was down
    bad_requests: int = 0  # engine calls whose arguments did not fit (logged, missed)
    connects: int = 0  # successful (re)connections

    def snapshot(self) -> dict[str, int]:
        return asdict(self)


class StoreLink:
    """One lazily (re)connected client of the owner on ``socket_path``; thread-safe."""

    def __init__(
        self,
        socket_path: str | Path,
        *,
        expected_owner_id: str | None = None,
        timeout_s: float = 5.0,
        retry_interval_s: float = 1.0,
        check: Callable[[BlockStoreClient], None] | None = None,
        hook: str = "storage",
    ) -> None:
        self.socket_path = Path(socket_path)
        self.expected_owner_id = expected_owner_id
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self.check = check
        self.hook = hook
        self.counters = HookCounters()
        self._lock = threading.Lock()
        self._client: BlockStoreClient | None = None
        self._next_try = 0.0  # monotonic time before which no reconnect is attempted
        self._down_logged = False  # one "unreachable" line per outage, not one per call
        self._closed = False

    @property
    def connected(self) -> bool:
        return self._client is not None

    def connect(self, *, strict: bool = False, fresh: bool = False) -> BlockStoreClient | None:
        """The connected client, connecting now if needed (ignoring the retry interval).

        ``fresh`` drops a live connection first, so ``check`` runs again (after the hook's
        own geometry changed). With ``strict``, a store whose geometry does not fit raises
        ``StoreMismatchError``; an unreachable store is never an error here (the hook keeps
        trying later).
        """
        with self._lock:
            if fresh:
                self._drop()
            self._next_try = 0.0
            return self._ensure(strict=strict)

    def client(self) -> BlockStoreClient | None:
        """The connected client, or None while the store is down (retried lazily)."""
        client = self._client
        if client is not None:
            return client
        with self._lock:
            return self._ensure(strict=False)

    def call(self, op: str, fn: Callable[[BlockStoreClient], R], fallback: R) -> R:
        """``fn(client)``, or ``fallback`` (logged and counted) when the store fails."""
        client = self.client()
        if client is None:
            self.counters.calls_unavailable += 1
            return fallback
        try:
            return fn(client)
        except Exception as exc:  # the engine boundary: a storage failure is a miss
            self._failed(op, client, exc)
            return fallback

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()

    # ------------------------------------------------------------------ internals
    def _ensure(self, *, strict: bool) -> BlockStoreClient | None:
        if self._client is not None or self._closed:
            return self._client
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + self.retry_interval_s
        try:
            client = BlockStoreClient(
                self.socket_path,
                expected_owner_id=self.expected_owner_id,
                timeout_s=self.timeout_s,
            )
        except (OSError, BlockStoreError) as exc:
            if not self._down_logged:
                self._down_logged = True
                log.warning("store_unreachable", hook=self.hook, socket=str(self.socket_path),
                            error=f"{type(exc).__name__}: {exc}",
                            retry_interval_s=self.retry_interval_s)
            return None
        try:
            if self.check is not None:
                self.check(client)
        except StoreMismatchError as exc:
            client.close()
            log.error("store_mismatched", hook=self.hook, socket=str(self.socket_path),
                      error=str(exc))
            if strict:
                raise
            return None
        except BaseException:
            client.close()
            raise
        self._client = client
        self._down_logged = False
        self.counters.connects += 1
        log.info("store_connected", hook=self.hook, socket=str(self.socket_path),
                 owner_id=client.welcome.owner_id, block_bytes=client.block_bytes,
                 dtype=client.dtype, layout=client.welcome.layout)
        return client

    def _failed(self, op: str, client: BlockStoreClient, exc: Exception) -> None:
        self.counters.calls_failed += 1
        if isinstance(exc, ClientDetachedError):
            with self._lock:
                if self._client is client:
                    self._drop()
                    self._next_try = 0.0  # the owner may be back already: try on next call
            log.warning("store_lost", hook=self.hook, op=op, socket=str(self.socket_path),
                        error=str(exc))
        elif isinstance(exc, BlockStoreError):
            log.warning("store_call_failed", hook=self.hook, op=op,
                        error=f"{type(exc).__name__}: {exc}")
        else:
            log.exception("store_call_crashed", hook=self.hook, op=op)

    def _drop(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            client.close()
