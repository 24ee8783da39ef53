"""The one registry of workers: what each is, which pool it serves, and whether to route to it.

A worker is a plain OpenAI-compatible engine (``--worker URL``) or one data-parallel rank
behind a kvsidecar sidecar (``--sidecar URL``, discovered). Two sources say whether it takes
requests, and both must:

* its **probe**: ``GET /health`` every ``--health-check-interval-s``; a request whose
  connection fails marks the probe failed too, until the next probe answers;
* for sidecar workers, its **stream**: the event stream must be connected, and the last
  ``WorkerStatus`` on it (every half second) must say routable; a stream that brought no
  status yet does not (its sidecar may stand beside an engine that is down). A stream
  refused because the worker does not hash as the gateway does (page size, model) leaves it
  placed by load alone, flagged as falling back (``parity.py``). A status that says routable
  while the probe is failed asks for a probe at once, so a recovered worker is back within
  one status interval instead of one probe interval.

Load is not counted here: ``routing.placement.active_load`` is the one in-flight count. A
status that carries the engine's own load reading is handed on to it (``on_engine_load``).
Data flows one way: probes, feeds and the pipeline report to the registry; placement reads
``routable()``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec
import structlog

from kvcore.stream import EngineLoad, WorkerStatus
from routing.config import WorkerAddress

__all__ = ["Health", "LoadSource", "Parity", "Role", "Worker", "WorkerKind", "WorkerRegistry"]

log = structlog.get_logger("routing.workers", component="workers")


class WorkerKind(enum.StrEnum):  # str: hashed in C, on the hot path
    PLAIN = "plain"  # an OpenAI-compatible engine: gets the client's request as is
    SIDECAR = "sidecar"  # a DP rank behind a kvsidecar sidecar: gets token ids


class Role(enum.StrEnum):
    """The pool a worker serves (a sidecar's ``--role``)."""

    AGG = "agg"
    PREFILL = "prefill"
    DECODE = "decode"


_NO_STATUS_YET = "its sidecar has sent no status yet"


class Health(enum.StrEnum):
    ROUTABLE = "routable"
    PROBE_FAILED = "probe_failed"  # /health failed, or a request's connection did
    STREAM_DOWN = "stream_down"  # the sidecar's event stream is not connected
    UNROUTABLE = "unroutable"  # the sidecar says so (draining, engine unhealthy, silent)


class LoadSource(enum.StrEnum):
    """What a worker's load is placed by."""

    ENGINE = "engine"  # the engine's own reading, beside the gateway's in-flight count
    GATEWAY = "gateway"  # the gateway's in-flight count alone


class Parity(enum.StrEnum):
    """Whether the gateway's block hashes are the worker's (``routing.workers.parity``)."""

    EXACT = "exact"
    DEGRADED = "degraded"  # routed, but its cache predictions are wrong
    FALLING_BACK = "falling_back"  # its stream was refused: placed by load alone
    UNVERIFIED = "unverified"
    PENDING = "pending"  # not judged yet: its first check is still to come


@dataclass(slots=True)
class Worker:
    """One worker and what the gateway knows of it."""

    worker_id: str
    address: WorkerAddress  # the engine (plain) or its sidecar
    kind: WorkerKind = WorkerKind.PLAIN
    dp_rank: int | None = None
    role: Role = Role.AGG
    models: tuple[str, ...] = ()
    probe_ok: bool = True
    probe_error: str | None = None
    last_probe_s: float | None = None
    stream_connected: bool = False
    stream_error: str | None = None
    status: WorkerStatus | None = None
    bootstrap: tuple[str, int] | None = None  # where a prefill engine serves its own transfer
    engine: WorkerAddress | None = None  # a sidecar's engine as others reach it (routing.epp)
    reasoning_parser: str | None = None  # its engine's (chats then go to its OpenAI server)
    dispatched: int = 0  # requests (legs) sent to it
    mismatch: str | None = None  # why its stream was refused (page size, model), if it was
    parity: Parity = Parity.PENDING
    parity_reason: str = "not checked yet"
    host_header: bytes = b""
    control_header: bytes = b""  # the sidecars' control token line (--sidecar-token-file)

    def __post_init__(self) -> None:
        a = self.address
        self.host_header = f"{a.host}:{a.port}".encode()

    @property
    def health(self) -> Health:
        if not self.probe_ok:
            return Health.PROBE_FAILED
        if self.kind is WorkerKind.SIDECAR:
            if not self.stream_connected:
                # A stream refused for a mismatch (page size, model) leaves the engine
                # serving: placed by load alone, and flagged loudly (``parity``).
                return Health.STREAM_DOWN if self.mismatch is None else Health.ROUTABLE
            if self.status is None or not self.status.routable:
                # Until its first status the gateway does not know whether the sidecar's
                # engine is up: a sidecar beside a dead or restarting engine streams too.
                return Health.UNROUTABLE
        return Health.ROUTABLE

    @property
    def reason(self) -> str:
        """Why the worker is not routable ("" when it is)."""
        match self.health:
            case Health.PROBE_FAILED:
                return self.probe_error or "health probe failed"
            case Health.STREAM_DOWN:
                return self.stream_error or "event stream not connected"
            case Health.UNROUTABLE:
                return self.status.reason if self.status is not None else _NO_STATUS_YET
        return ""

    @property
    def capacity_blocks(self) -> int | None:
        return None if self.status is None else self.status.capacity_blocks

    @property
    def engine_load(self) -> EngineLoad | None:
        """The engine's own load reading, from the last status (when it publishes one)."""
        return None if self.status is None else self.status.engine_load

    @property
    def load_source(self) -> LoadSource:
        return LoadSource.GATEWAY if self.engine_load is None else LoadSource.ENGINE


class WorkerRegistry:
    """Every worker, in the order they joined, and the routable ones per role."""

    def __init__(
        self,
        on_capacity: Callable[[str, int | None], None],
        on_engine_load: Callable[[str, EngineLoad | None], None] | None = None,
    ) -> None:
        """``on_capacity(worker_id, blocks)``: a worker's KV capacity became known (the
        placement core scores the decode pool by it). ``on_engine_load(worker_id, load)``:
        a status brought the engine's own load reading, or the reading went away (None)."""
        self._workers: dict[str, Worker] = {}
        self._routable: dict[Role, list[Worker]] | None = None
        self._routable_ids: dict[Role, list[str]] | None = None
        self._models: list[str] | None = None
        self._on_capacity = on_capacity
        self._on_engine_load = on_engine_load
        self.probe_soon: Callable[[Worker], None] = lambda worker: None  # set by the prober
        self.check_parity: Callable[[Worker], None] = lambda worker: None  # by the checker

    def __iter__(self) -> Iterator[Worker]:
        return iter(self._workers.values())

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    # --- membership ------------------------------------------------------------------------

    def add(self, worker: Worker) -> None:
        if worker.worker_id in self._workers:
            raise ValueError(f"worker id {worker.worker_id!r} is already registered")
        self._workers[worker.worker_id] = worker
        self._changed()
        log.info("worker_added", worker_id=worker.worker_id, kind=worker.kind.value,
                 url=worker.address.url)

    def remove(self, worker_id: str) -> None:
        if self._workers.pop(worker_id, None) is not None:
            self._changed()
            log.info("worker_removed", worker_id=worker_id)

    # --- what the sources report -------------------------------------------------------------

    def probed(self, worker: Worker, ok: bool, error: str | None = None) -> None:
        """A probe answered (or a request's connection failed: ``ok`` False)."""
        if worker.probe_ok != ok:
            worker.probe_ok = ok
            self._changed()
            if ok:
                log.info("worker_recovered", worker_id=worker.worker_id)
            else:
                log.warning("worker_marked_unhealthy", worker_id=worker.worker_id, error=error)
        if error is not None:
            worker.probe_error = error

    def stream_up(self, worker_id: str, role: str) -> None:
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        worker.stream_connected, worker.stream_error = True, None
        worker.role = Role(role)
        worker.mismatch = None
        self._changed()
        self.check_parity(worker)

    def stream_down(self, worker_id: str, error: str | None) -> None:
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        worker.stream_error = error
        if worker.stream_connected:
            worker.stream_connected = False
            self._changed()
        status = worker.status
        if status is not None and status.engine_load is not None:
            # No more readings will come on this stream: the last one must not linger.
            worker.status = msgspec.structs.replace(status, engine_load=None)
            if self._on_engine_load is not None:
                self._on_engine_load(worker_id, None)

    def mismatched(self, worker_id: str, reason: str) -> None:
        """The worker's stream was refused: it does not hash as the gateway does."""
        worker = self._workers.get(worker_id)
        if worker is not None and worker.mismatch != reason:
            worker.mismatch = reason
            self._changed()
            self.check_parity(worker)

    def reported(self, status: WorkerStatus) -> None:
        """A sidecar's ``WorkerStatus`` arrived on the worker's stream."""
        worker = self._workers.get(status.worker_id)
        if worker is None:
            return
        before = worker.status
        worker.status = status
        if before is None or before.capacity_blocks != status.capacity_blocks:
            self._on_capacity(worker.worker_id, status.capacity_blocks)
        if self._on_engine_load is not None and (
            status.engine_load is not None
            or (before is not None and before.engine_load is not None)
        ):
            self._on_engine_load(worker.worker_id, status.engine_load)
        if (
            before is None
            or before.routable != status.routable
            or before.role != status.role
        ):
            worker.role = Role(status.role)
            self._changed()
        if status.routable and not worker.probe_ok:
            self.probe_soon(worker)

    # --- views -------------------------------------------------------------------------------

    def routable(self, role: Role = Role.AGG) -> list[Worker]:
        """The workers of ``role`` that take requests now (cached until something changes)."""
        pools = self._routable
        if pools is None:
            pools = self._pools()
        return pools[role]

    def routable_ids(self, role: Role = Role.AGG) -> list[str]:
        """The ids of ``routable(role)`` (cached with it: asked per request)."""
        ids = self._routable_ids
        if ids is None:
            self._pools()
            ids = self._routable_ids
            assert ids is not None
        return ids[role]

    def _pools(self) -> dict[Role, list[Worker]]:
        pools: dict[Role, list[Worker]] = {r: [] for r in Role}
        for worker in self._workers.values():
            if worker.health is Health.ROUTABLE:
                pools[worker.role].append(worker)
        self._routable = pools
        self._routable_ids = {r: [w.worker_id for w in ws] for r, ws in pools.items()}
        return pools

    def has_roles(self) -> bool:
        """Whether any worker serves a prefill or decode pool."""
        return any(w.role is not Role.AGG for w in self._workers.values())

    def models(self) -> list[str]:
        """Every model some worker serves, in the order they joined (cached: asked per
        request)."""
        models = self._models
        if models is None:
            seen: dict[str, None] = {}
            for worker in self._workers.values():
                for name in worker.models:
                    seen.setdefault(name, None)
            models = self._models = list(seen)
        return models

    def learned_models(self, worker: Worker, models: tuple[str, ...]) -> None:
        """A probe learned what ``worker`` serves."""
        worker.models = models
        self._models = None

    def _changed(self) -> None:
        self._routable = None
        self._routable_ids = None
        self._models = None
