"""The event relay's core: one sequenced, resumable stream of a worker's KV events.

Events from the engine adapter (GPU tier) and from the block store (host tier) are stamped
with this worker's id, the relay's epoch and the next sequence number, applied to a mirror,
encoded once, and kept in a bounded replay buffer. A subscriber that reconnects with an
(epoch, seq) still covered by the buffer gets the missed frames; otherwise a snapshot of the
mirror. Pure and synchronous; ``event_stream.py`` serves it over HTTP.

The epoch is the relay's incarnation (microseconds since the epoch at start), so a restarted
sidecar always has a newer epoch than its predecessor and gateways clear what it held.
"""

from __future__ import annotations

import time
from collections import deque

import msgspec

from kvcore.events import KVEvent
from kvcore.stream import StreamStart
from kvcore.wire import encode
from sidecar.mirror import BlockMirror

__all__ = ["EventRelay", "StreamPlan"]


class StreamPlan(msgspec.Struct, frozen=True):
    """What a new subscriber is sent before live frames: the start frame, then ``backlog``."""

    start: StreamStart
    backlog: list[bytes]


class EventRelay:
    """Stamps, mirrors, encodes and buffers one worker's events."""

    def __init__(
        self,
        worker_id: str,
        *,
        block_size: int,
        model_id: str,
        role: str = "agg",
        buffer_events: int = 65536,
        epoch: int | None = None,
    ) -> None:
        if buffer_events < 1:
            raise ValueError(f"buffer_events must be >= 1, got {buffer_events}")
        self.worker_id = worker_id
        self.block_size = block_size
        self.model_id = model_id
        self.role = role
        self.epoch = epoch if epoch is not None else time.time_ns() // 1000
        self.seq = 0
        self.mirror = BlockMirror()
        self._buffer: deque[bytes] = deque(maxlen=buffer_events)  # frames seq-len+1 .. seq

    def publish(self, event: KVEvent) -> bytes:
        """Stamp and record an event; returns its frame for the live subscribers."""
        self.seq += 1
        stamped = msgspec.structs.replace(
            event, worker_id=self.worker_id, epoch=self.epoch, seq=self.seq
        )
        self.mirror.apply(stamped)
        frame = encode(stamped)
        self._buffer.append(frame)
        return frame

    def plan(self, epoch: int | None, seq: int | None, *, tokens: bool = True) -> StreamPlan:
        """What to send a subscriber whose last applied event was (epoch, seq); a snapshot
        without the blocks' token ids unless ``tokens``."""
        oldest = self.seq - len(self._buffer)  # the buffer holds events oldest+1 .. self.seq
        if epoch == self.epoch and seq is not None and oldest <= seq <= self.seq:
            backlog = list(self._buffer)[seq - oldest :]
            return StreamPlan(self._start("replay", seq), backlog)
        snapshot = self.mirror.snapshot(self.worker_id, self.epoch, self.seq, tokens=tokens)
        return StreamPlan(self._start("snapshot", self.seq), [encode(snapshot)])

    def marker(self) -> StreamStart:
        """Where the stream stands: a start frame at the last stamped event (what a
        JetStream consumer behind it learns it missed)."""
        return self._start("replay", self.seq)

    def _start(self, mode: str, seq: int) -> StreamStart:
        return StreamStart(
            self.worker_id,
            self.epoch,
            seq,
            mode,  # type: ignore[arg-type]
            self.block_size,
            self.model_id,
            self.role,  # type: ignore[arg-type]
        )
