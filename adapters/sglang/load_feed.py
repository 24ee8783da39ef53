"""The engine's own load, per worker: SGLang's load sockets read into a board of readings.

``LoadBoard`` (pure, clock injected) keeps each worker's newest reading and when it came; a
corrupt message is counted (``decode_errors``, kind ``load``) and logged, at most once per
``_LOG_EVERY_S`` per worker with how many were not logged, and the reading before it stays.
A reading older than ``stale_after_s`` is not answered: SGLang re-sends an unchanged reading
about once a second, so silence that long means the scheduler (or its socket) is gone, and
the gateway goes back to its own count.

``LoadSubscriber`` is the ZMQ shell: one SUB socket per DP rank (the socket says which rank a
reading is for, as SGLang intends), all polled by one task. The sockets connect when it is
built, so a malformed endpoint fails the adapter's start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import msgspec
import structlog
import zmq
import zmq.asyncio

from adapters.base import EventEndpoint
from adapters.normalize_metrics import AdapterMetrics
from adapters.sglang.load_wire import decode_load, to_engine_load
from adapters.zmq_events.framing import FrameError
from kvcore.stream import EngineLoad

__all__ = ["LoadBoard", "LoadSubscriber"]

log = structlog.get_logger(component="adapters.sglang")

_HEAD = 64
_LOG_EVERY_S = 10.0
_RCVHWM = 64  # a gauge: a backlog beyond this is stale anyway


class _Slot:
    __slots__ = ("at_s", "last_log_s", "load", "unlogged")

    def __init__(self) -> None:
        self.load: EngineLoad | None = None
        self.at_s = 0.0
        self.last_log_s: float | None = None
        self.unlogged = 0  # corrupt messages since the last one logged


class LoadBoard:
    """The newest engine load reading of each worker."""

    def __init__(
        self,
        metrics: AdapterMetrics,
        stale_after_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if stale_after_s <= 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s}")
        self.metrics = metrics
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._slots: dict[str, _Slot] = {}

    def receive(self, worker_id: str, frames: list[bytes]) -> bool:
        """Take one message from ``worker_id``'s load socket; False when it was corrupt."""
        slot = self._slots.get(worker_id)
        if slot is None:
            slot = self._slots[worker_id] = _Slot()
        metrics = self.metrics
        try:
            _, stat = decode_load(frames)
        except FrameError as exc:
            metrics.decode_errors.labels(metrics.engine, worker_id, "load").inc()
            self._log_corrupt(worker_id, slot, str(exc), b"".join(frames))
            return False
        slot.load = to_engine_load(stat)
        slot.at_s = self._clock()
        metrics.load_readings.labels(metrics.engine, worker_id).inc()
        return True

    def get(self, worker_id: str) -> EngineLoad | None:
        """The worker's newest reading with its age, or None (none yet, or stale)."""
        slot = self._slots.get(worker_id)
        if slot is None or slot.load is None:
            return None
        age_s = self._clock() - slot.at_s
        if age_s > self.stale_after_s:
            return None
        return msgspec.structs.replace(slot.load, age_ms=max(0, int(age_s * 1000)))

    def _log_corrupt(self, worker_id: str, slot: _Slot, reason: str, raw: bytes) -> None:
        now = self._clock()
        if slot.last_log_s is not None and now - slot.last_log_s < _LOG_EVERY_S:
            slot.unlogged += 1
            return
        log.error(
            "engine_load_decode_failed",
            worker_id=worker_id,
            reason=reason,
            raw_len=len(raw),
            raw_head=raw[:_HEAD].hex(),
            not_logged_before=slot.unlogged,
        )
        slot.last_log_s = now
        slot.unlogged = 0


class LoadSubscriber:
    """Reads every DP rank's load socket into a ``LoadBoard`` until cancelled."""

    def __init__(
        self,
        ranks: Sequence[tuple[str, EventEndpoint]],
        ctx: zmq.asyncio.Context,
        board: LoadBoard,
    ) -> None:
        self.board = board
        self._sockets: dict[zmq.asyncio.Socket, str] = {}
        try:
            for worker_id, endpoint in ranks:
                sub = ctx.socket(zmq.SUB)
                self._sockets[sub] = worker_id
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.RCVHWM, _RCVHWM)
                sub.setsockopt(zmq.SUBSCRIBE, endpoint.topic.encode("utf-8"))
                sub.connect(endpoint.endpoint)
                log.info(
                    "engine_load_subscribed", worker_id=worker_id, endpoint=endpoint.endpoint
                )
        except BaseException:
            self.close()
            raise

    async def run(self) -> None:
        poller = zmq.asyncio.Poller()
        for sub in self._sockets:
            poller.register(sub, zmq.POLLIN)
        try:
            while True:
                for sub, _ in await poller.poll():
                    frames = await sub.recv_multipart()
                    self.board.receive(self._sockets[sub], frames)
        finally:
            self.close()

    def close(self) -> None:
        """Close every socket; idempotent."""
        sockets, self._sockets = self._sockets, {}
        for sub in sockets:
            sub.close(linger=0)
