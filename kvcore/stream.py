"""Messages of the sidecar → gateway event stream, beside the events themselves.

One stream per sidecar worker (``GET /v1/kv-events`` on the sidecar, docs/event-stream.md). It
opens with ``StreamStart``; then either the missed events (``mode="replay"``) or a
``WorkerSnapshot`` (``mode="snapshot"``), then live events. ``WorkerStatus`` frames
are interleaved (with the engine's own ``EngineLoad`` when it publishes one); they carry no
sequence number. ``ResyncRequired`` is the last frame a
subscriber gets when it fell too far behind: reconnect from the last applied position.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from kvcore.events import Counter, WorkerId

__all__ = ["EngineLoad", "ResyncRequired", "Role", "StreamStart", "WorkerStatus"]

Role = Literal["agg", "prefill", "decode"]


class StreamStart(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=6):
    """The stream's first frame: where it starts and what the worker's cache speaks."""

    worker_id: WorkerId
    epoch: Counter
    seq: Counter  # replay: events seq+1.. follow; snapshot: the snapshot is at this seq
    mode: Literal["replay", "snapshot"]
    block_size: Annotated[int, Meta(ge=1, le=4096)]
    model_id: str
    role: Role = "agg"


class EngineLoad(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A worker's load as its engine's own scheduler reports it (SGLang's load socket), not
    as anyone in front of it counts: it sees every client of the engine, not only ours."""

    running: Counter  # requests in the running batch
    queued: Counter  # requests waiting to be scheduled
    kv_used_tokens: Counter  # KV tokens held by requests (cached but evictable ones excluded)
    kv_capacity_tokens: Counter | None = None  # the KV pool, when the engine says
    queued_prefill_tokens: Counter = 0  # uncached prompt tokens waiting for prefill
    age_ms: Counter = 0  # how old the reading was when its sidecar sent it

    @property
    def kv_usage(self) -> float | None:
        """The fraction of the KV pool in use (None when the pool's size is unknown)."""
        capacity = self.kv_capacity_tokens
        return self.kv_used_tokens / capacity if capacity else None

    def view(self) -> dict[str, int | float | None]:
        """The reading as a JSON object (the sidecar's ``/v1/load``, the gateway's
        ``/v1/workers``)."""
        usage = self.kv_usage
        return {
            "running": self.running,
            "queued": self.queued,
            "kv_used_tokens": self.kv_used_tokens,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "kv_usage": None if usage is None else round(usage, 4),
            "queued_prefill_tokens": self.queued_prefill_tokens,
            "age_ms": self.age_ms,
        }


class WorkerStatus(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=7):
    """Whether to route to a worker at all, and how much KV it holds, as its sidecar sees it.

    Sent every ``--load-report-interval-s``. The gateway counts what it has in flight itself
    (``routing.placement.active_load``); ``engine_load``, when the engine publishes its own
    (None otherwise), adds what that count cannot see: other clients, the engine's queue.
    """

    worker_id: WorkerId
    ts_ms: Counter
    routable: bool = True
    reason: str = ""  # why the worker is not routable, when it is not
    role: Role = "agg"
    capacity_blocks: Counter | None = None  # the engine's KV capacity, when it says
    engine_load: EngineLoad | None = None  # appended: older peers ignore it or default it


class ResyncRequired(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=8):
    """The subscriber was dropped (e.g. it fell behind); it must reconnect and resync."""

    worker_id: WorkerId
    reason: str
