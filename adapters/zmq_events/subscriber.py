"""The ZMQ shell around a ``BatchNormalizer``: one SUB socket (plus replay) per DP rank.

* **Live**: SUB connected to the rank's PUB endpoint, subscribed to its topic.
* **Replay**: a fresh DEALER per request to the rank's ROUTER, ``[b"", start_seq]``, then
  ``[b"", topic, seq, payload]`` (SGLang; vLLM 0.32 too) or ``[b"", seq, payload]`` (older
  vLLM) messages until the seq frame is all ``0xff``. A DEALER, not a REQ: a REQ socket can
  only ever receive the first reply.
* **Startup** replays from 0 so a subscriber that joins late still rebuilds the cache from
  the publisher's buffer; while idle it probes the replay socket every ``idle_probe_s`` for
  batches the PUB/SUB pipe dropped at the tail (nothing follows them to reveal the gap).
* **Restarts**: the SUB socket reconnecting after losing its TCP peer (socket monitor), or a
  live seq going backwards, means a new publisher: new epoch, then rebuild from its replay
  buffer.
* **Resync** (``_resync``): new epoch (``AllBlocksCleared``) then replay from 0: exact when
  the buffer still starts at seq 0, else a conservative subset. Without a replay endpoint a
  resync is the new epoch alone.

Backpressure: normalized events go to the adapter's bounded queue with ``await put``; while
it is full this rank stops reading, ZMQ queues up to its high-water mark and then drops,
and the dropped seqs come back as a gap that replay fills.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from adapters.base import AdapterConfig, EventEndpoint, worker_id_for
from adapters.normalize import WorkerNormalizer
from adapters.normalize_metrics import AdapterMetrics
from adapters.zmq_events.framing import END_SEQ, FrameError, parse_seq
from adapters.zmq_events.sequencer import RankSequencer, SeqAction
from kvcore.events import KVEvent
from kvcore.hashing import BlockHasher

__all__ = ["RankCore", "RankSubscriber", "subscribe_ranks"]

log = structlog.get_logger(component="adapters.zmq_events")

Emit = Callable[[list[KVEvent]], Awaitable[None]]
_HEAD = 64
_MAX_PROBE_INTERVAL_S = 30.0


class RankCore(Protocol):
    """What the subscriber drives: one rank's batch normalizer (``BatchNormalizer``)."""

    normalizer: WorkerNormalizer

    def apply(self, seq: int, payload: bytes, out: list[KVEvent]) -> bool: ...

    def publisher_restarted(self) -> None: ...

    def resync(self, out: list[KVEvent]) -> None: ...


def subscribe_ranks(
    config: AdapterConfig,
    endpoints: Sequence[EventEndpoint],
    block_size: int,
    ctx: zmq.asyncio.Context,
    emit: Emit,
    metrics: AdapterMetrics,
    make_core: Callable[[WorkerNormalizer], RankCore],
    *,
    idle_probe_s: float = 1.0,
) -> list[RankSubscriber]:
    """One subscriber per DP rank's endpoint, each rank its canonical worker
    (``worker_id_for``) normalized by the core ``make_core`` builds around it."""
    hasher = BlockHasher(block_size)
    subscribers = []
    for ep in endpoints:
        worker = worker_id_for(config.worker_id, ep.dp_rank, len(endpoints))
        norm = WorkerNormalizer(worker, config.model_id, hasher, metrics)
        subscribers.append(RankSubscriber(
            ep, ctx, make_core(norm), emit, metrics,
            replay_timeout_s=config.replay_timeout_s, idle_probe_s=idle_probe_s,
        ))
    return subscribers


class _ReplayFailedError(Exception):
    """The replay socket did not answer in time."""


class RankSubscriber:
    """Consumes one DP rank's KV events until cancelled."""

    def __init__(
        self,
        endpoint: EventEndpoint,
        ctx: zmq.asyncio.Context,
        core: RankCore,
        emit: Emit,
        metrics: AdapterMetrics,
        *,
        replay_timeout_s: float = 2.0,
        idle_probe_s: float = 1.0,
    ) -> None:
        self.endpoint = endpoint
        self._ctx = ctx
        self._core = core
        self._emit = emit
        self._seq = RankSequencer()
        self._replay_timeout_s = replay_timeout_s
        self._idle_probe_s = idle_probe_s
        self._probe_every_s = idle_probe_s  # grows while the replay socket does not answer
        self._topic = endpoint.topic.encode("utf-8")
        worker = core.normalizer.worker_id
        self.worker_id = self._worker = worker
        self._gaps = metrics.gaps.labels(metrics.engine, worker)
        self._metrics = metrics
        self._peer_lost = False
        self._moved = False  # ``move_to`` gave another endpoint: the loop reconnects there
        self.connected = asyncio.Event()

    @property
    def peer_lost(self) -> bool:
        """The publisher's connection dropped and has not come back (an engine restart, which
        may have bound new ports: ``move_to``)."""
        return self._peer_lost

    def move_to(self, endpoint: EventEndpoint) -> None:
        """The publisher is at ``endpoint`` now (an engine restarted on ephemeral ports): the
        loop drops its socket and state and rebuilds from there, as after a restart."""
        if endpoint != self.endpoint:
            log.warning("kv_publisher_moved", worker_id=self._worker, old=self.endpoint.endpoint,
                        new=endpoint.endpoint)
            self.endpoint = endpoint
            self._topic = endpoint.topic.encode("utf-8")
            self._moved = True

    # --- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        moved = False
        while True:
            await self._run_connected(moved)
            moved = True  # ``_run_connected`` returns only when the publisher moved

    async def _run_connected(self, moved: bool) -> None:
        """Consume the current endpoint until cancelled, or until it moves."""
        self._moved = False
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            sub.connect(self.endpoint.endpoint)
            log.info(
                "kv_subscriber_started",
                worker_id=self._worker,
                endpoint=self.endpoint.endpoint,
                replay_endpoint=self.endpoint.replay_endpoint,
            )
            if moved:
                self._peer_lost = False
                await self._resync("publisher_moved")
            elif self.endpoint.replay_endpoint is not None:
                await self._rebuild()
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            last_activity = time.monotonic()
            while not self._moved:
                ready = dict(await poller.poll(timeout=self._poll_ms()))
                if monitor in ready:
                    await self._on_monitor(parse_monitor_message(await monitor.recv_multipart()))
                    continue
                if sub in ready:
                    await self._on_live(await sub.recv_multipart())
                    last_activity = time.monotonic()
                elif (
                    self.endpoint.replay_endpoint is not None
                    and time.monotonic() - last_activity >= self._probe_every_s
                ):
                    await self._probe()
                    last_activity = time.monotonic()
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _poll_ms(self) -> int:
        return max(1, int(self._idle_probe_s * 1000))

    async def _on_monitor(self, event: Mapping[str, Any]) -> None:
        if event["event"] == zmq.EVENT_CONNECTED:
            self.connected.set()
            if self._peer_lost:
                # A new TCP peer: most likely a restarted engine. Rebuild from its buffer.
                self._peer_lost = False
                await self._resync("publisher_reconnected")
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            # Maybe a restart; decided for certain only when messages flow again.
            self._peer_lost = True
            self.connected.clear()
            log.warning("kv_publisher_disconnected", worker_id=self._worker)

    async def _on_live(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise FrameError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
            seq = parse_seq(frames[1])
        except FrameError as exc:
            self._frame_error(str(exc), b"".join(frames))
            await self._resync("malformed_frame")
            return
        action = self._seq.on_live(seq)
        if action is SeqAction.RESTART:
            await self._resync("sequence_reset")
            action = self._seq.recheck(seq)
        if action is SeqAction.GAP:
            self._gaps.inc()
            log.warning(
                "kv_event_gap_detected",
                worker_id=self._worker,
                expected=(self._seq.last_applied or 0) + 1,
                got=seq,
            )
            await self._fill_gap()
            action = self._seq.recheck(seq)
            if action is SeqAction.GAP:  # replay could not reach it: start over
                await self._resync("gap_unfillable")
                action = self._seq.recheck(seq)
        if action is SeqAction.APPLY:
            await self._apply(seq, frames[2], resync_on_error=True)

    # --- applying -------------------------------------------------------------------------

    async def _apply(self, seq: int, payload: bytes, *, resync_on_error: bool) -> None:
        out: list[KVEvent] = []
        ok = self._core.apply(seq, payload, out)
        self._seq.applied(seq)
        if out:
            await self._emit(out)
        if not ok and resync_on_error:
            await self._resync("malformed_event")

    async def _resync(self, reason: str) -> None:
        self._metrics.resyncs.labels(self._metrics.engine, self._worker, reason).inc()
        log.warning("kv_worker_resynced", worker_id=self._worker, reason=reason)
        if reason in ("sequence_reset", "publisher_reconnected", "publisher_moved"):
            self._core.publisher_restarted()
        out: list[KVEvent] = []
        self._core.resync(out)
        await self._emit(out)
        self._seq.reset()
        if self.endpoint.replay_endpoint is not None:
            await self._rebuild()

    async def _rebuild(self) -> None:
        """Replay everything the publisher still buffers (seq 0 on) into an empty state."""
        try:
            await self._replay(0, rebuilding=True)
        except _ReplayFailedError:
            return  # continue live: the state is a subset until events arrive

    async def _fill_gap(self) -> None:
        start = (self._seq.last_applied or 0) + 1
        try:
            await self._replay(start, rebuilding=False)
        except _ReplayFailedError:
            return

    async def _probe(self) -> None:
        if self._peer_lost:
            return  # the publisher is gone; its reconnection resyncs
        start = 0 if self._seq.last_applied is None else self._seq.last_applied + 1
        try:
            await self._replay(start, rebuilding=self._seq.last_applied is None, probe=True)
        except _ReplayFailedError:
            self._probe_every_s = min(self._probe_every_s * 2, _MAX_PROBE_INTERVAL_S)
            return
        self._probe_every_s = self._idle_probe_s

    async def _replay(self, start: int, *, rebuilding: bool, probe: bool = False) -> None:
        """Ask the ROUTER for seq >= ``start`` and apply what comes back, in order."""
        assert self.endpoint.replay_endpoint is not None
        replays = self._metrics.replays
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        applied = 0
        try:
            dealer.connect(self.endpoint.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(timeout=int(self._replay_timeout_s * 1000)):
                    replays.labels(self._metrics.engine, self._worker, "timeout").inc()
                    log.warning(
                        "kv_replay_timed_out",
                        worker_id=self._worker,
                        start=start,
                        timeout_s=self._replay_timeout_s,
                    )
                    raise _ReplayFailedError
                frames = await dealer.recv_multipart()
                if len(frames) not in (3, 4) or frames[0] != b"":
                    self._frame_error(
                        f"replay reply has {len(frames)} frames, expected 3 or 4",
                        b"".join(frames),
                    )
                    continue
                if frames[-2] == END_SEQ:
                    break
                try:
                    seq = parse_seq(frames[-2])
                except FrameError as exc:
                    self._frame_error(str(exc), b"".join(frames))
                    continue
                action = self._seq.on_replay(seq)
                if action is SeqAction.RANGE_GONE:
                    replays.labels(self._metrics.engine, self._worker, "range_gone").inc()
                    log.warning(
                        "kv_replay_range_gone", worker_id=self._worker, wanted=start, first=seq
                    )
                    dealer.close(linger=0)
                    await self._resync("replay_range_gone")
                    return
                if action is SeqAction.APPLY:
                    # Errors while rebuilding are counted; resyncing again would loop.
                    await self._apply(seq, frames[-1], resync_on_error=not rebuilding)
                    applied += 1
        finally:
            dealer.close(linger=0)
        if not probe or applied:
            replays.labels(self._metrics.engine, self._worker, "ok").inc()
            log.info("kv_replay_completed", worker_id=self._worker, start=start, batches=applied)

    def _frame_error(self, reason: str, raw: bytes) -> None:
        self._metrics.decode_errors.labels(self._metrics.engine, self._worker, "frame").inc()
        log.error(
            "kv_event_decode_failed",
            worker_id=self._worker,
            kind="frame",
            reason=reason,
            raw_len=len(raw),
            raw_head=raw[:_HEAD].hex(),
        )
