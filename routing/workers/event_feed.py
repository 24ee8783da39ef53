"""The gateway's subscription to one sidecar's event stream (docs/event-stream.md).

Keeps the sidecar's worker in the router's prefix index: subscribes from the last applied
(epoch, seq), applies events, loads snapshots, reconnects after a drop or a resync request,
and when the sidecar stays unreachable for ``dead_after_s`` removes the worker's blocks from
the index until it comes back. Decoding errors are counted and end in a resync; they never
stop the feed. What the stream says of the worker (connected or not, its role, its
``WorkerStatus``) goes to a ``FeedListener``: the gateway's worker registry.

With ``--events-via nats`` the live events come from JetStream (``LiveEvents``,
``routing/replicas/durable.py``) while it is live: the feed then asks its sidecar for
``events=0`` (the start, the backlog since its position, status frames, and live events
only while the sidecar cannot publish them to NATS). It reconnects, at the next status
frame, when that changes or when the worker was found behind on JetStream. A gateway that
keeps no XXH3 table (the index has no observer) asks ``tokens=0``: snapshots without the
blocks' token ids, which only that table reads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp
import structlog

from kvcore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WorkerSnapshot,
)
from kvcore.stream import ResyncRequired, StreamStart, WorkerStatus
from kvcore.wire import FRAME_HEADER, WireError, decode
from routing.placement.kv_router import KvRouter
from routing.placement.prefix_index import ApplyOutcome

__all__ = [
    "FeedListener",
    "FeedStats",
    "LiveEvents",
    "SidecarFeed",
    "StreamMismatchError",
    "StreamProtocolError",
]

_MAX_FRAME_BYTES = 256 << 20
_EVENTS = (BlockStored, BlockRemoved, AllBlocksCleared)

log = structlog.get_logger(component="event_feed")


class StreamProtocolError(Exception):
    """The sidecar sent something the protocol does not allow here."""


class StreamMismatchError(StreamProtocolError):
    """The sidecar's worker does not hash as the gateway does (page size, model)."""


class FeedListener(Protocol):
    """Who hears what a stream says of its worker."""

    def stream_up(self, worker_id: str, role: str) -> None: ...
    def stream_down(self, worker_id: str, error: str | None) -> None: ...
    def reported(self, status: WorkerStatus) -> None: ...
    def mismatched(self, worker_id: str, reason: str) -> None: ...


class LiveEvents(Protocol):
    """Where the live events come from instead of the stream (``--events-via nats``)."""

    def live(self) -> bool: ...
    def take_resync(self, worker_id: str) -> bool: ...


class _Resync(Exception):
    """Reconnect now and resync from the last applied position."""


@dataclass(slots=True)
class FeedStats:
    connects: int = 0
    events: int = 0
    snapshots: int = 0
    replays: int = 0
    resyncs: int = 0
    decode_errors: int = 0
    removals: int = 0


class SidecarFeed:
    """One sidecar's stream, applied to a ``KvRouter``."""

    def __init__(
        self,
        url: str,
        router: KvRouter,
        session: aiohttp.ClientSession,
        *,
        model_id: str,
        worker: str | None = None,
        dead_after_s: float = 5.0,
        idle_timeout_s: float = 10.0,
        retry_s: float = 0.2,
        listener: FeedListener | None = None,
        clock: Callable[[], float] = time.monotonic,
        live_events: LiveEvents | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.router = router
        self.model_id = model_id
        self.dead_after_s = dead_after_s
        self.idle_timeout_s = idle_timeout_s
        self.retry_s = retry_s
        self.listener = listener
        self.live_events = live_events
        self._session = session
        self._clock = clock
        self.worker_id: str | None = worker  # learned from the stream when not given
        self.connected = False
        self.error: str | None = None  # why the feed is not live
        self.stats = FeedStats()
        self._down_since: float | None = None
        self._removed = False
        self.live = asyncio.Event()  # set while connected and synced

    async def run(self) -> None:
        """Subscribe forever (until cancelled), reconnecting and resyncing as needed."""
        retry = self.retry_s
        while True:
            try:
                await self._consume()
                retry = self.retry_s
            except _Resync as exc:
                self.stats.resyncs += 1
                log.info("stream_resync", url=self.url, reason=str(exc))
                continue
            except (aiohttp.ClientError, TimeoutError, ConnectionError, StreamProtocolError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                log.info("stream_disconnected", url=self.url, error=self.error)
                if (isinstance(exc, StreamMismatchError) and self.listener is not None
                        and self.worker_id is not None):
                    self.listener.mismatched(self.worker_id, str(exc))
            finally:
                self.connected = False
                self.live.clear()
                if self.listener is not None and self.worker_id is not None:
                    self.listener.stream_down(self.worker_id, self.error)
            self._note_down()
            await asyncio.sleep(retry)
            retry = min(retry * 2, 2.0)

    def _note_down(self) -> None:
        now = self._clock()
        if self._down_since is None:
            self._down_since = now
        if (
            not self._removed
            and self.worker_id is not None
            and now - self._down_since >= self.dead_after_s
        ):
            lost = self.router.remove_worker(self.worker_id)
            self._removed = True
            self.stats.removals += 1
            log.warning("worker_removed", worker_id=self.worker_id, url=self.url, lost=len(lost))

    async def _consume(self) -> None:
        params: dict[str, str] = {"worker": self.worker_id} if self.worker_id else {}
        position = self.router.index.position(self.worker_id) if self.worker_id else None
        resumable = position is not None and not self._removed
        if resumable and not self.router.index.needs_resync(self.worker_id):  # type: ignore[arg-type]
            params.update(epoch=str(position[0]), seq=str(position[1]))  # type: ignore[index]
        if self.router.index.observer is None:  # no XXH3 table: the snapshot's tokens are unused
            params["tokens"] = "0"
        live = self.live_events
        status_only = live is not None and live.live()
        if live is not None and status_only:
            params["events"] = "0"
            if self.worker_id is not None:
                live.take_resync(self.worker_id)  # this connect resyncs it
        timeout = aiohttp.ClientTimeout(total=None, connect=2.0, sock_read=self.idle_timeout_s)
        async with self._session.get(
            f"{self.url}/v1/kv-events", params=params, timeout=timeout
        ) as resp:
            if resp.status != 200:
                raise StreamProtocolError(f"HTTP {resp.status} from {self.url}/v1/kv-events")
            self.stats.connects += 1
            start = await self._read(resp)
            if not isinstance(start, StreamStart):
                raise StreamProtocolError(f"stream began with {type(start).__name__}")
            self._check(start)
            if start.mode == "snapshot":
                snapshot = await self._read(resp)
                if not isinstance(snapshot, WorkerSnapshot):
                    raise StreamProtocolError(f"expected a snapshot, got {type(snapshot).__name__}")
                self.router.index.load_worker_snapshot(snapshot)
                self.stats.snapshots += 1
            else:
                self.stats.replays += 1
            self.connected, self.error, self._down_since, self._removed = True, None, None, False
            self.live.set()
            if self.listener is not None:
                self.listener.stream_up(start.worker_id, start.role)
            log.info("stream_connected", url=self.url, worker_id=start.worker_id, mode=start.mode)
            while True:
                message = await self._read(resp)
                if isinstance(message, _EVENTS):
                    outcome = self.router.apply(message)
                    self.stats.events += 1
                    if outcome is ApplyOutcome.GAP:
                        raise _Resync(f"gap before seq {message.seq}")
                elif isinstance(message, WorkerStatus):
                    if self.listener is not None:
                        self.listener.reported(message)
                    if live is not None and (live.live() != status_only or (
                            status_only and live.take_resync(start.worker_id))):
                        raise _Resync("events now via " + ("nats" if live.live() else "stream"))
                elif isinstance(message, ResyncRequired):
                    raise _Resync(message.reason)
                else:
                    raise StreamProtocolError(f"unexpected {type(message).__name__} mid-stream")

    def _check(self, start: StreamStart) -> None:
        if start.block_size != self.router.block_size:
            raise StreamMismatchError(
                f"page size mismatch: sidecar block size {start.block_size} != gateway block "
                f"size {self.router.block_size} (--block-size): overlaps would silently be zero"
            )
        if start.model_id != self.model_id:
            raise StreamMismatchError(
                f"model mismatch: sidecar serves model {start.model_id!r}, gateway expects "
                f"{self.model_id!r} (its namespace, so its hashes, differ)"
            )
        if self.worker_id is not None and start.worker_id != self.worker_id:
            raise StreamProtocolError(
                f"sidecar at {self.url} changed worker id {self.worker_id!r} → {start.worker_id!r}"
            )
        self.worker_id = start.worker_id

    async def _read(self, resp: aiohttp.ClientResponse) -> object:
        try:
            header = await resp.content.readexactly(FRAME_HEADER.size)
        except asyncio.IncompleteReadError as exc:
            raise ConnectionError("stream ended") from exc
        (length,) = FRAME_HEADER.unpack(header)
        if length > _MAX_FRAME_BYTES:
            raise StreamProtocolError(f"frame of {length} bytes exceeds {_MAX_FRAME_BYTES}")
        try:
            frame = await resp.content.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise ConnectionError("stream ended mid-frame") from exc
        try:
            return decode(frame)
        except WireError as exc:
            self.stats.decode_errors += 1
            log.warning("stream_frame_invalid", url=self.url, error=str(exc), raw_len=length)
            raise _Resync(f"invalid frame: {exc}") from exc
