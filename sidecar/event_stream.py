"""Serving the relay over HTTP: ``GET /v1/kv-events?epoch=E&seq=S``.

The response body is a sequence of frames, each a 4-byte big-endian length followed by one
wire frame (``kvcore.wire``). Every subscriber has a bounded queue; the relay
never waits for a subscriber. One that falls ``queue_frames`` behind is dropped with a
``ResyncRequired`` frame, counted, and reconnects on its own from its last position — the
replay buffer usually still covers it, otherwise it gets a snapshot. Other subscribers and
the engine are unaffected. A new subscriber gets the worker's status right after its start
(the snapshot or the replayed backlog), then one every report interval.

With ``--events-via nats`` each frame is first offered to the JetStream publisher (the
``outlet``). A subscriber that asked ``events=0`` (a gateway reading events from JetStream)
gets the start, the backlog and the status frames, and of the live events only those the
outlet refused (NATS unreachable): it loses none either way. One that asked ``tokens=0``
(a gateway that keeps no XXH3 table) gets its snapshot without the blocks' token ids.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
from aiohttp import web

from kvcore.events import KVEvent
from kvcore.stream import ResyncRequired, WorkerStatus
from kvcore.wire import FRAME_HEADER, Message, encode, join_frames
from sidecar.relay import EventRelay

__all__ = ["FRAME_HEADER", "STREAM_CONTENT_TYPE", "EventStream"]

STREAM_CONTENT_TYPE = "application/x-kvsidecar-stream"
_WRITE_BATCH_FRAMES = 256

log = structlog.get_logger(component="event_stream")


class _Subscriber:
    __slots__ = ("events", "overrun", "peer", "queue")

    def __init__(self, peer: str, queue_frames: int, events: bool = True) -> None:
        self.peer = peer
        self.events = events  # False: live events only when the outlet refused them
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=queue_frames)
        self.overrun = False


class EventStream:
    """Fans the relay's frames out to any number of HTTP subscribers."""

    def __init__(self, relay: EventRelay, *, queue_frames: int = 8192) -> None:
        self.relay = relay
        self.queue_frames = queue_frames
        self._subscribers: set[_Subscriber] = set()
        self._direct: set[_Subscriber] = set()  # those that take every live event here
        # The JetStream publisher: True when it took the frame (--events-via nats).
        self.outlet: Callable[[bytes], bool] | None = None
        # Other formats this stream is republished in (--publish-zmq), given every event.
        self.taps: list[Callable[[KVEvent], None]] = []
        # The worker's status now, sent to a new subscriber right after its start: a gateway
        # routes to the worker only once it has one, and the next report is up to
        # --load-report-interval-s away.
        self.status: Callable[[], WorkerStatus] | None = None
        self.events_relayed = 0
        self.subscribers_dropped = 0
        self.replays_served = 0
        self.snapshots_served = 0
        self._closing = False

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    @property
    def num_status_only(self) -> int:
        """Subscribers that read the live events from JetStream."""
        return len(self._subscribers) - len(self._direct)

    def publish(self, event: KVEvent) -> None:
        """Stamp, record and send one event to every live subscriber (those reading
        JetStream only when the outlet refused it)."""
        frame = self.relay.publish(event)
        for tap in self.taps:
            tap(event)
        outlet = self.outlet
        if outlet is not None and outlet(frame):
            self._fanout(frame, self._direct)
        else:
            self._fanout(frame, self._subscribers)
        self.events_relayed += 1

    def broadcast(self, message: Message) -> None:
        """Send an unsequenced message (a load report) to every live subscriber."""
        if self._subscribers:
            self._fanout(encode(message), self._subscribers)

    def close(self) -> None:
        """End every subscriber's stream (shutdown)."""
        self._closing = True
        for sub in self._subscribers:
            self._end(sub)

    def _fanout(self, frame: bytes, subscribers: set[_Subscriber]) -> None:
        for sub in subscribers:
            if sub.overrun:
                continue
            try:
                sub.queue.put_nowait(frame)
            except asyncio.QueueFull:
                sub.overrun = True
                self.subscribers_dropped += 1
                log.warning("subscriber_overrun", peer=sub.peer, queue_frames=self.queue_frames)
                self._end(sub)

    @staticmethod
    def _end(sub: _Subscriber) -> None:
        while not sub.queue.empty():
            sub.queue.get_nowait()
        sub.queue.put_nowait(None)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """The ``GET /v1/kv-events`` handler."""
        try:
            epoch = _optional_int(request.query.get("epoch"))
            seq = _optional_int(request.query.get("seq"))
        except ValueError as exc:
            raise web.HTTPBadRequest(
                text=f'{{"error": "epoch and seq must be non-negative integers: {exc}"}}',
                content_type="application/json",
            ) from exc
        if self._closing:
            raise web.HTTPServiceUnavailable(text='{"error": "sidecar is shutting down"}')
        events = request.query.get("events") != "0"
        sub = _Subscriber(request.remote or "?", self.queue_frames, events)
        # plan() and registration happen with no await between them, so no frame is lost.
        plan = self.relay.plan(epoch, seq, tokens=request.query.get("tokens") != "0")
        self._subscribers.add(sub)
        if events:
            self._direct.add(sub)
        if plan.start.mode == "replay":
            self.replays_served += 1
        else:
            self.snapshots_served += 1
        response = web.StreamResponse(headers={"Content-Type": STREAM_CONTENT_TYPE})
        try:
            await response.prepare(request)
            frames = [encode(plan.start), *plan.backlog]
            if self.status is not None:
                frames.append(encode(self.status()))
            await response.write(join_frames(frames))
            await self._pump(sub, response)
        except (ConnectionResetError, ConnectionError):
            log.info("subscriber_disconnected", peer=sub.peer)
        finally:
            self._subscribers.discard(sub)
            self._direct.discard(sub)
        return response

    async def _pump(self, sub: _Subscriber, response: web.StreamResponse) -> None:
        queue = sub.queue
        while True:
            frame = await queue.get()
            batch = []
            while frame is not None:
                batch.append(frame)
                if len(batch) >= _WRITE_BATCH_FRAMES or queue.empty():
                    break
                frame = queue.get_nowait()
            if batch:
                await response.write(join_frames(batch))
            if frame is None:
                reason = "shutting down" if self._closing else "subscriber fell behind"
                resync = ResyncRequired(self.relay.worker_id, reason)
                await response.write(join_frames([encode(resync)]))
                await response.write_eof()
                return


def _optional_int(raw: str | None) -> int | None:
    if raw is None or raw == "":
        return None
    value = int(raw)
    if value < 0:
        raise ValueError(f"got {raw}")
    return value
