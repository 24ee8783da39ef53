"""Messages of the sidecar → gateway event stream, beside the events themselves.

One stream per sidecar worker (``GET /v1/kv-events`` on the sidecar, docs/event-stream.md). It
opens with ``StreamStart``; then either the missed events (``mode="replay"``) or a
``WorkerSnapshot`` (``mode="snapshot"``), then live events. ``WorkerStatus`` frames
are interleaved; they carry no sequence number. ``ResyncRequired`` is the last frame a
subscriber gets when it fell too far behind: reconnect from the last applied position.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from kvcore.events import Counter, WorkerId

__all__ = ["ResyncRequired", "Role", "StreamStart", "WorkerStatus"]

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


class WorkerStatus(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=7):
    """Whether to route to a worker at all, and how much KV it holds, as its sidecar sees it.

    Sent every ``--load-report-interval-s``. It carries no load: the gateway counts what it
    has in flight itself (``routing.placement.active_load``, its one in-flight count).
    """

    worker_id: WorkerId
    ts_ms: Counter
    routable: bool = True
    reason: str = ""  # why the worker is not routable, when it is not
    role: Role = "agg"
    capacity_blocks: Counter | None = None  # the engine's KV capacity, when it says


class ResyncRequired(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=8):
    """The subscriber was dropped (e.g. it fell behind); it must reconnect and resync."""

    worker_id: WorkerId
    reason: str
