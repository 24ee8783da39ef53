"""What the pipeline's stages work with: passed in explicitly, never the whole gateway."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from routing.http.client import UpstreamPool
from routing.metrics import GatewayMetrics
from routing.pd.coordinator import PdCoordinator
from routing.pipeline.admission import AdmissionQueue, Busy
from routing.pipeline.prefix_moves import PrefixMoves
from routing.pipeline.route_refusals import RouteRefusals
from routing.pipeline.slo import Slo
from routing.placement.kv_router import KvRouter
from routing.placement.policies import Policy
from routing.placement.sessions import SessionAffinity
from routing.prompt.flights import TokenizeFlights
from routing.prompt.preparer import PromptPreparer
from routing.replicas.prompt_hold import PromptHold
from routing.workers.registry import WorkerRegistry

__all__ = ["InFlightRequest", "PipelineContext"]


class InFlightRequest(Protocol):
    """What the gateway sees of a request in flight: its last activity, for the sweep."""

    last_activity: float

    def timed_out(self) -> None: ...


@dataclass(frozen=True, slots=True)
class PipelineContext:
    """The gateway's parts a request needs, and its settings."""

    router: KvRouter
    policy: Policy
    prompts: PromptPreparer
    workers: WorkerRegistry
    upstream: UpstreamPool
    metrics: GatewayMetrics
    pd: PdCoordinator | None
    spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]
    in_flight: dict[str, InFlightRequest]  # by key: the sweep times them out, stop drains them
    model_names: Callable[[], Sequence[str]]  # the names clients may ask for (empty: any)
    busy: Busy | None  # when a worker takes no more (None: never busy)
    admission: AdmissionQueue | None  # where requests wait when every worker is busy
    sessions: SessionAffinity | None  # x-session-id → worker (None: no affinity)
    forwarded_headers: tuple[bytes, ...]  # client headers the workers see too (lower-case)
    log_requests: bool  # one canonical log line per request (debug level)
    migration_limit: int = 0  # times a stream may go on on another worker
    # with other gateway replicas: where a new prompt another replica owns waits for it
    prompt_hold: PromptHold | None = None
    # The routes workers' engines lack (not a placement's ``Refusal``).
    refusals: RouteRefusals = field(default_factory=RouteRefusals)
    slo: Slo = field(default_factory=Slo)  # each request's targets unless it names its own
    moves: PrefixMoves | None = None  # --kv-move on: prefixes pulled to a lighter worker
    # long prompt texts being tokenized off the loop now (each tokenized once at a time)
    tokenizing: TokenizeFlights = field(default_factory=TokenizeFlights)
