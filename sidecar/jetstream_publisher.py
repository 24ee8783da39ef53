"""The sidecar's KV events, also published to NATS JetStream (``--events-via nats``).

Every frame the relay stamps (``sidecar/relay.py``) is offered here before it goes to the
HTTP subscribers; the frame is the same bytes, already encoded. Frames wait in one bounded
queue and a publisher task sends them, each event-loop tick's frames of one worker joined as
one message (``kvcore.wire.join_frames``), to ``kvsidecar.events.<model>.<worker>`` in the
model's stream (``kvcore.jetstream``), which this sidecar creates when missing: limits
retention, ``--events-max-age-s`` and ``--events-max-bytes``, oldest discarded first.

The relay never waits for NATS. While NATS is unreachable (or the queue is full) a frame is
refused: counted as dropped, and the relay sends it directly to every subscriber of the
HTTP stream instead, those that asked for status only included, so a gateway loses nothing.
On every (re)connect, after the frames still queued, each worker's ``StreamStart`` goes to
the stream as a marker: a consumer behind its ``(epoch, seq)`` knows it missed events and
resyncs from the sidecar, as after any gap (docs/replicas.md, "Durable events").
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvcore import nats_extra
from kvcore.jetstream import events_subject, events_subjects, stream_name
from kvcore.wire import encode, join_frames
from sidecar.event_stream import EventStream

__all__ = ["JetStreamPublisher", "PublisherMetrics"]

log = structlog.get_logger(component="jetstream_publisher")

_MAX_MESSAGE_BYTES = 256 << 10  # below NATS' default 1 MiB payload limit, whatever it is set to


class PublisherMetrics:
    """What the publisher did, for the sidecar's ``/metrics``."""

    def __init__(self) -> None:
        self.connected = False
        self.frames_published = 0
        self.messages_published = 0
        self.frames_dropped = 0  # refused or lost: the HTTP stream carried them instead
        self.markers_published = 0
        self.nats_errors = 0

    def collect(self) -> Iterator[Metric]:
        p = "kvsidecar_jetstream_"
        for name, doc, value in (
            ("frames_published", "Event frames published to JetStream", self.frames_published),
            ("messages_published", "JetStream messages (batches of frames) published",
             self.messages_published),
            ("frames_dropped", "Event frames not published: NATS unreachable or the queue full",
             self.frames_dropped),
            ("markers_published", "Stream position markers published after a (re)connect",
             self.markers_published),
            ("nats_errors", "Failed NATS connects and connection errors", self.nats_errors),
        ):
            yield CounterMetricFamily(p + name, doc, value=value)
        yield GaugeMetricFamily(p + "connected", "1 while publishing to JetStream",
                                value=int(self.connected))


class JetStreamPublisher:
    """Publishes every worker's stamped frames; ``run()`` until cancelled."""

    def __init__(
        self,
        streams: Mapping[str, EventStream],
        *,
        url: str,
        model_id: str,
        max_age_s: float,
        max_bytes: int,
        queue_frames: int = 65536,
    ) -> None:
        self._nats = nats_extra.load("kvsidecar sidecar --events-via nats")
        self.url = url
        self.model_id = model_id
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self._streams = streams
        self._queue: deque[tuple[str, bytes]] = deque()
        self._queue_frames = queue_frames
        self._wake = asyncio.Event()
        self._up = False  # connected and the stream exists: frames are taken
        self._markers_due = False
        self._nc: Any = None
        self.metrics = PublisherMetrics()
        for worker_id, stream in streams.items():
            stream.outlet = self._outlet(events_subject(model_id, worker_id))

    def _outlet(self, subject: str) -> Callable[[bytes], bool]:
        queue, wake, limit, metrics = self._queue, self._wake, self._queue_frames, self.metrics

        def offer(frame: bytes) -> bool:
            """Take a frame for JetStream; False: the HTTP stream must carry it."""
            if not self._up or len(queue) >= limit:
                metrics.frames_dropped += 1
                self._markers_due = True
                return False
            queue.append((subject, frame))
            wake.set()
            return True

        return offer

    async def run(self) -> None:
        """Connect (retrying for ever) and publish, until cancelled; then close."""
        nc = self._nc = self._nats.NATS()
        log.info("jetstream_publisher_starting", url=self.url, stream=stream_name(self.model_id))
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._connect(nc))
                tasks.create_task(self._publish_loop(nc))
        finally:
            self._up = False
            await nats_extra.close_quietly(self._nats, nc, log)

    # --- connection ----------------------------------------------------------------------

    async def _connect(self, nc: Any) -> None:
        await nats_extra.connect(
            nc, self.url, f"kvsidecar-sidecar-{'-'.join(self._streams)}"[:200],
            error_cb=self._on_error, disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_connected,
        )
        await self._on_connected()

    async def _on_connected(self) -> None:
        try:
            await self._ensure_stream()
        except (TimeoutError, self._nats.errors.Error) as exc:
            await self._on_error(exc)
            return
        log.info("jetstream_connected", url=self.url, stream=stream_name(self.model_id))
        self.metrics.connected = self._up = self._markers_due = True
        self._wake.set()

    async def _ensure_stream(self) -> None:
        api = self._nats.js.api
        config = api.StreamConfig(
            name=stream_name(self.model_id),
            subjects=[events_subjects(self.model_id)],
            retention=api.RetentionPolicy.LIMITS,
            discard=api.DiscardPolicy.OLD,
            storage=api.StorageType.FILE,
            max_age=self.max_age_s,
            max_bytes=self.max_bytes,
        )
        js = self._nc.jetstream()
        try:
            await js.add_stream(config)
        except self._nats.js.errors.BadRequestError as exc:  # there, with other limits
            log.warning("events_stream_differs", stream=config.name, error=str(exc),
                        using="the stream as it is")

    async def _on_disconnected(self) -> None:
        self._up = False
        if self.metrics.connected:
            self.metrics.connected = False
            log.warning("jetstream_disconnected", url=self.url, then="events go direct")

    async def _on_error(self, exc: Exception) -> None:
        m = self.metrics
        m.nats_errors += 1
        if m.nats_errors == 1 or m.connected:  # once per outage, not once per retry
            log.warning("nats_unreachable", url=self.url, error=repr(exc))

    # --- publishing ----------------------------------------------------------------------

    async def _publish_loop(self, nc: Any) -> None:
        queue, wake, metrics = self._queue, self._wake, self.metrics
        while True:
            await wake.wait()
            wake.clear()
            if not self._up:
                metrics.frames_dropped += len(queue)
                queue.clear()
                continue
            if self._markers_due:  # after what is queued: it covers every frame before it
                self._markers_due = False
                for worker_id, stream in self._streams.items():
                    marker = encode(stream.relay.marker())
                    queue.append((events_subject(self.model_id, worker_id), marker))
                    metrics.markers_published += 1
            batches: dict[str, list[bytes]] = {}
            while queue:
                subject, frame = queue.popleft()
                batches.setdefault(subject, []).append(frame)
            for subject, frames in batches.items():
                for payload, count in _messages(frames):
                    try:
                        await nc.publish(subject, payload)
                    except self._nats.errors.Error as exc:
                        metrics.frames_dropped += count
                        self._markers_due = True
                        log.warning("jetstream_publish_failed", frames=count, error=repr(exc))
                        continue
                    metrics.messages_published += 1
                    metrics.frames_published += count


def _messages(frames: list[bytes]) -> Iterator[tuple[bytes, int]]:
    """Frames joined into messages of at most ``_MAX_MESSAGE_BYTES`` (one frame may exceed it
    alone), with how many frames each holds."""
    start, size = 0, 0
    for i, frame in enumerate(frames):
        if size and size + len(frame) + 4 > _MAX_MESSAGE_BYTES:
            yield join_frames(frames[start:i]), i - start
            start, size = i, 0
        size += len(frame) + 4
    if start < len(frames):
        yield join_frames(frames[start:]), len(frames) - start
