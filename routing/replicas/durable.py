"""KV events read from NATS JetStream, and the index snapshots a gateway starts from
(``--events-via nats``; docs/replicas.md, "Durable events").

Start: connect, load the newest index snapshot (``snapshots.py``) into the router's empty
index, then read the model's stream (``kvcore.jetstream``) from the message after the one
the snapshot covers, applying each message's frames as a sidecar feed would. The consumer
is ephemeral, unacknowledged and without flow control (nats-py answers flow control only
every 0.25 s, which stalls a replay): messages lost on the way (a slow consumer) show as a
jump in the stream sequence, and the consumer starts again after the last one applied.
Caught up with the stream's last message as of subscribing, the events are *live*: the
sidecar feeds (``routing.workers.event_feed``) then ask their sidecars for status only, and
catch up from them on what the stream lacks.

Nothing here has to be exact, because every event carries its worker's (epoch, seq): the
index drops what it has already applied, so events that reach it twice (the stream and a
feed, a snapshot newer than its stream position) are harmless. A worker found behind — a
gap in its sequence, or a sidecar's position marker ahead of it (the sidecar dropped frames
while NATS was away) — is told to its feed (``take_resync``), which resyncs it from the
sidecar as today. While NATS is unreachable the events are not live and the feeds carry
them; back, the consumer resumes after the last message applied.

Every ``--snapshot-interval-s`` the whole index is written as its own arrays with the stream
sequence it covers: copied on the loop (tens of milliseconds per million blocks), packed in a
thread (``scripts/bench_warm_start.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from kvcore import nats_extra
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvcore.jetstream import events_subjects, stream_name
from kvcore.stream import StreamStart
from kvcore.wire import WireError, decode, split_frames
from routing.config import EventsVia, RouterConfig
from routing.placement.kv_router import KvRouter
from routing.placement.prefix_index import ApplyOutcome, PrefixIndex
from routing.replicas.link import ReplicaLink
from routing.replicas.metrics import DurableMetrics
from routing.replicas.snapshots import (
    DurableSnapshot,
    SnapshotStore,
    decode_snapshot,
    encode_snapshot,
)

__all__ = ["DurableEvents", "decode_events"]

log = structlog.get_logger("routing.replicas", component="durable_events")

_FRAMES = (BlockStored, BlockRemoved, AllBlocksCleared, StreamStart)  # what a message holds
_START_TIMEOUT_S = 30.0  # the longest a start waits for the snapshot and the stream
_NO_STREAM_RETRY_S = 1.0
_CONSUMER_IDLE_S = 30.0  # the server drops a consumer nobody reads (a gateway gone)


class DurableEvents:
    """The model's JetStream events applied to a router, and its index snapshots."""

    def __init__(
        self,
        router: KvRouter,
        *,
        url: str,
        model_id: str,
        replica_id: str,
        snapshot_interval_s: float,
    ) -> None:
        self._nats = nats_extra.load("kvsidecar gateway --events-via nats")
        self.router = router
        self.url = url
        self.model_id = model_id
        self.snapshot_interval_s = snapshot_interval_s
        self.metrics = DurableMetrics()
        self._stream = stream_name(model_id)
        self._key = f"index-{replica_id}"
        self._nc: Any = None
        self._js: Any = None
        self._sub: Any = None
        self._store: SnapshotStore | None = None
        self._subscribing = asyncio.Lock()
        self._tasks: asyncio.TaskGroup | None = None
        self._resync: set[str] = set()
        self._live_at = 0  # live once this stream message is applied
        self._written_seq = 0
        self._first_connect = True
        self._contiguous = False  # a message since subscribing: each next one follows it
        self._settled = asyncio.Event()  # the start is over: caught up, or NATS is away
        self._started = time.monotonic()

    @classmethod
    def build(
        cls,
        cfg: RouterConfig,
        router: KvRouter,
        replicas: ReplicaLink | None,
        registry: CollectorRegistry,
    ) -> DurableEvents | None:
        """The gateway's, with ``--events-via nats`` (which needs ``--nats``), its metrics
        registered; else None."""
        if cfg.events_via is not EventsVia.NATS or replicas is None:
            return None
        durable = cls(router, url=replicas.url, model_id=cfg.model_names[0],
                      replica_id=replicas.replica_id,
                      snapshot_interval_s=cfg.snapshot_interval_s)
        registry.register(durable.metrics)
        return durable

    async def start(self, spawn: Callable[[Coroutine[Any, Any, None]], object]) -> None:
        """Run (a task of the owner's ``spawn``) and wait until the index is warm."""
        spawn(self.run())
        await self.settled()

    # --- what the sidecar feeds ask (routing.workers.event_feed.LiveEvents) --------------

    def live(self) -> bool:
        """True while the events come from JetStream (the feeds then carry status only)."""
        return self.metrics.live

    def take_resync(self, worker_id: str) -> bool:
        """True once after the worker was found behind on the stream."""
        if worker_id in self._resync:
            self._resync.discard(worker_id)
            return True
        return False

    async def settled(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Wait (at most ``timeout_s``) until the index is warm, or NATS is found away."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._settled.wait()
        except TimeoutError:
            log.warning("durable_start_timeout", timeout_s=timeout_s, then="following anyway")

    # --- lifecycle -----------------------------------------------------------------------

    async def run(self) -> None:
        """Connect (retrying for ever), read the stream and write snapshots, until
        cancelled; then close."""
        self._started = time.monotonic()
        nc = self._nc = self._nats.NATS()
        log.info("durable_events_starting", url=self.url, stream=self._stream)
        try:
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                tasks.create_task(self._connect(nc))
                if self.snapshot_interval_s > 0:
                    tasks.create_task(self._snapshot_loop())
                await asyncio.get_running_loop().create_future()  # the connection lives on
        finally:
            self.metrics.live = False
            await nats_extra.close_quietly(self._nats, nc, log)

    async def _connect(self, nc: Any) -> None:
        await nats_extra.connect(
            nc, self.url, f"kvsidecar-gateway-events-{self._key}",
            error_cb=self._on_error, disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
        )
        self._js = nc.jetstream()
        self._store = SnapshotStore(self._nats, self._js, self.model_id)
        await self._subscribe()

    async def _on_reconnected(self) -> None:
        log.info("nats_reconnected", url=self.url, resume_after=self.metrics.stream_seq)
        if self._tasks is not None:
            self._tasks.create_task(self._subscribe())

    async def _on_disconnected(self) -> None:
        if self.metrics.live:
            self.metrics.live = False
            log.warning("durable_events_down", url=self.url, then="events via the sidecars")

    async def _on_error(self, exc: Exception) -> None:
        if isinstance(exc, self._nats.errors.SlowConsumerError):
            return  # seen as a jump in the stream sequence: the consumer starts again
        m = self.metrics
        m.nats_errors += 1
        if m.nats_errors == 1 or m.live:  # once per outage, not once per retry
            log.warning("nats_unreachable", url=self.url, error=repr(exc))
        self._settled.set()  # a start does not wait for NATS: the sidecars carry the events

    # --- reading -------------------------------------------------------------------------

    async def _subscribe(self) -> None:
        """(Re)subscribe after the last message applied; waits for the stream to exist."""
        async with self._subscribing:
            old, self._sub = self._sub, None
            if old is not None:
                try:
                    await old.unsubscribe()
                except self._nats.errors.Error as exc:
                    log.debug("durable_unsubscribe_failed", error=repr(exc))
            try:
                while True:
                    try:
                        info = await self._js.stream_info(self._stream)
                        break
                    except self._nats.js.errors.NotFoundError:
                        self._settled.set()  # no sidecar has published yet: nothing to wait for
                        await asyncio.sleep(_NO_STREAM_RETRY_S)
                if self._first_connect:
                    self._first_connect = False
                    await self._start_from(info.state.last_seq)
                await self._consume(info.state.last_seq)
            except (TimeoutError, self._nats.errors.Error) as exc:
                await self._on_error(exc)  # the reconnect subscribes again

    async def _start_from(self, last_seq: int) -> None:
        """Where a first subscription starts: after the newest snapshot, when the index is
        still empty; after the stream's end when the sidecars' streams got there first."""
        m = self.metrics
        if self.router.index.worker_ids:
            m.stream_seq = last_seq
            log.info("durable_joined_late", stream_seq=last_seq, reason="index already built")
            return
        snapshot = await self._read_snapshot()
        if snapshot is None:
            return
        self.router.index.load_image(snapshot.image)
        m.snapshot_loaded_blocks = self.router.index.num_blocks()
        if snapshot.stream_seq > last_seq:
            log.warning("events_stream_restarted", snapshot_seq=snapshot.stream_seq,
                        stream_last_seq=last_seq, then="replaying it whole")
        else:
            m.stream_seq = snapshot.stream_seq
        log.info("snapshot_loaded", stream_seq=m.stream_seq, blocks=m.snapshot_loaded_blocks,
                 workers=len(snapshot.image.workers))

    async def _read_snapshot(self) -> DurableSnapshot | None:
        assert self._store is not None
        try:
            data = await self._store.read_newest()
            if data is None:
                log.info("durable_cold_start", reason="no snapshot yet")
                return None
            snapshot = decode_snapshot(data)
            if snapshot.model_id != self.model_id or \
                    snapshot.block_size != self.router.block_size:
                raise WireError(f"snapshot of model {snapshot.model_id!r}, block size "
                                f"{snapshot.block_size}; this gateway: {self.model_id!r}, "
                                f"{self.router.block_size}")
            return snapshot
        except WireError as exc:
            self.metrics.snapshot_failures += 1
            log.warning("snapshot_rejected", error=str(exc), then="cold start")
            return None

    async def _consume(self, last_seq: int) -> None:
        api = self._nats.js.api
        m = self.metrics
        config = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=m.stream_seq + 1,
            ack_policy=api.AckPolicy.NONE, max_deliver=1, mem_storage=True, num_replicas=1,
            inactive_threshold=_CONSUMER_IDLE_S)
        self._live_at = last_seq
        self._contiguous = False
        self._sub = await self._js.subscribe(events_subjects(self.model_id), stream=self._stream,
                                             cb=self._on_message, config=config)
        log.info("durable_subscribed", stream=self._stream, after=m.stream_seq, until=last_seq)
        if m.stream_seq >= last_seq:
            self._go_live()

    async def _on_message(self, msg: Any) -> None:
        m = self.metrics
        seq = msg.metadata.sequence.stream
        if seq <= m.stream_seq:
            return  # delivered again, after a new subscription
        if seq != m.stream_seq + 1 and self._contiguous:
            self._contiguous = False  # lost on the way: start again after the last applied
            log.warning("durable_messages_lost", after=m.stream_seq, got=seq, then="resubscribe")
            if self._tasks is not None:
                self._tasks.create_task(self._subscribe())
            return
        self._contiguous = True
        m.stream_seq = seq
        m.messages += 1
        try:
            messages = decode_events(msg.data)
        except WireError as exc:
            m.messages_rejected += 1
            log.warning("durable_message_rejected", subject=msg.subject, stream_seq=seq,
                        raw_len=len(msg.data), raw_head=bytes(msg.data[:32]).hex(),
                        error=str(exc))
        else:
            self._apply(messages)
        if not m.live and seq >= self._live_at:
            self._go_live()

    def _apply(self, messages: list[KVEvent | StreamStart]) -> None:
        apply, gap, applied = self.router.apply, ApplyOutcome.GAP, 0
        for message in messages:
            if isinstance(message, StreamStart):
                position = self.router.index.position(message.worker_id)
                if position is not None and (message.epoch, message.seq) > position:
                    self._behind(message.worker_id)  # the sidecar dropped frames meanwhile
            elif apply(message) is gap:
                self._behind(message.worker_id)
            else:
                applied += 1
        self.metrics.events_applied += applied

    def _behind(self, worker_id: str) -> None:
        self._resync.add(worker_id)
        self.metrics.gaps += 1
        log.info("durable_worker_behind", worker_id=worker_id, then="resync from its sidecar")

    def _go_live(self) -> None:
        m = self.metrics
        m.live = True
        if not m.warm_start_s:
            m.warm_start_s = round(time.monotonic() - self._started, 4)
            log.info("durable_warm_start", seconds=m.warm_start_s, stream_seq=m.stream_seq,
                     snapshot_blocks=m.snapshot_loaded_blocks,
                     blocks=self.router.index.num_blocks())
        self._settled.set()
        log.info("durable_events_live", stream_seq=m.stream_seq)

    # --- snapshots -----------------------------------------------------------------------

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.snapshot_interval_s)
            if self.metrics.live and self.metrics.stream_seq != self._written_seq:
                try:
                    await self.write_snapshot()
                except (TimeoutError, self._nats.errors.Error) as exc:
                    self.metrics.snapshot_failures += 1
                    log.warning("snapshot_not_written", error=repr(exc))

    async def write_snapshot(self) -> None:
        """The whole index and the stream message it covers, to the object store."""
        assert self._store is not None
        seq = self.metrics.stream_seq
        started = time.perf_counter()
        index = self.router.index.copy()  # on the loop, with its position: consistent
        copied = time.perf_counter()
        frame = await asyncio.to_thread(_pack, self.model_id, self.router.block_size, seq, index)
        packed = time.perf_counter()
        await self._store.write(self._key, seq, frame)
        self._written_seq = self.metrics.snapshot_seq = seq
        self.metrics.snapshots_written += 1
        log.info("snapshot_written", stream_seq=seq, bytes=len(frame),
                 copy_ms=round((copied - started) * 1000, 1),
                 pack_ms=round((packed - copied) * 1000, 1),
                 write_ms=round((time.perf_counter() - packed) * 1000, 1))


def _pack(model_id: str, block_size: int, seq: int, index: PrefixIndex) -> bytes:
    """A snapshot's bytes, off the event loop (its columns are built by C loops that hold
    the interpreter a few tens of milliseconds each, not the whole packing)."""
    return encode_snapshot(DurableSnapshot(model_id, block_size, seq, index.to_image()))


def decode_events(data: bytes) -> list[KVEvent | StreamStart]:
    """A JetStream message's frames: events and position markers only, else ``WireError``."""
    out: list[KVEvent | StreamStart] = []
    for frame in split_frames(data):
        message = decode(frame)
        if not isinstance(message, _FRAMES):
            raise WireError(f"{type(message).__name__} has no place on the event stream")
        out.append(message)
    return out
