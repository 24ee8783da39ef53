"""The workers the gateway places requests on, their health, and the probe loop.

A worker is healthy until a connection to it fails or a probe fails; the probe loop
(``GET /health`` every ``interval_s``) brings it back when it answers again. Model names are
learned from each worker's ``/v1/models`` when the operator did not name them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson
import structlog

from routing.config import WorkerAddress
from routing.serve.upstream import simple_request

__all__ = ["Worker", "WorkerSet"]

log = structlog.get_logger("routing.workers.registry").bind(component="workers")


@dataclass(slots=True)
class Worker:
    """One plain OpenAI-compatible engine and what the gateway knows of it."""

    address: WorkerAddress
    worker_id: str
    healthy: bool = True
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    models: tuple[str, ...] = ()
    last_probe_s: float | None = None
    last_error: str | None = None
    host_header: bytes = field(default=b"")
    kind: str = "plain"  # "plain": an OpenAI engine; "sidecar": a kvsidecar sidecar
    dp_rank: int | None = None  # the engine's data-parallel rank this worker is (sidecars)

    def __post_init__(self) -> None:
        a = self.address
        self.host_header = f"{a.host}:{a.port}".encode()


class WorkerSet:
    """All workers, in configuration order."""

    def __init__(self, addresses: Sequence[WorkerAddress], probe_timeout_s: float) -> None:
        self.workers = {a.url: Worker(a, a.url) for a in addresses}
        self.probe_timeout_s = probe_timeout_s
        self._healthy_cache: list[Worker] | None = None

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.workers.values())

    def get(self, worker_id: str) -> Worker:
        return self.workers[worker_id]

    def add(self, worker: Worker) -> None:
        """A worker joins (a sidecar was discovered)."""
        self.workers[worker.worker_id] = worker
        self._healthy_cache = None
        log.info("worker_added", worker_id=worker.worker_id, kind=worker.kind,
                 url=worker.address.url)

    def remove(self, worker_id: str) -> None:
        """A worker leaves (its sidecar was removed from the configuration)."""
        if self.workers.pop(worker_id, None) is not None:
            self._healthy_cache = None
            log.info("worker_removed", worker_id=worker_id)

    def healthy(self) -> list[Worker]:
        cached = self._healthy_cache
        if cached is None:
            cached = self._healthy_cache = [w for w in self.workers.values() if w.healthy]
        return cached

    def mark(self, worker: Worker, healthy: bool, error: str | None = None) -> None:
        if worker.healthy != healthy:
            worker.healthy = healthy
            self._healthy_cache = None
            if healthy:
                log.info("worker_recovered", worker_id=worker.worker_id)
            else:
                log.warning("worker_marked_unhealthy", worker_id=worker.worker_id, error=error)
        if error is not None:
            worker.last_error = error

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for worker in self.workers.values():
            for name in worker.models:
                seen.setdefault(name, None)
        return list(seen)

    async def probe(self, worker: Worker, discover_models: bool) -> None:
        a = worker.address
        try:
            status, _ = await simple_request(
                a.host, a.port, "GET", a.base_path + "/health", self.probe_timeout_s
            )
            if status != 200:
                raise OSError(f"GET /health answered {status}")
            if discover_models and not worker.models:
                status, body = await simple_request(
                    a.host, a.port, "GET", a.base_path + "/v1/models", self.probe_timeout_s
                )
                if status == 200:
                    data = orjson.loads(body).get("data") or []
                    worker.models = tuple(str(m["id"]) for m in data if "id" in m)
        except (OSError, TimeoutError, ValueError, KeyError, AttributeError) as exc:
            self.mark(worker, False, f"{type(exc).__name__}: {exc}")
        else:
            self.mark(worker, True)
        finally:
            worker.last_probe_s = time.time()

    async def probe_all(self, discover_models: bool) -> None:
        async with asyncio.TaskGroup() as tg:
            for worker in self.workers.values():
                tg.create_task(self.probe(worker, discover_models))

    async def run_probes(self, interval_s: float, discover_models: bool) -> None:
        """Probe every worker every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.probe_all(discover_models)
