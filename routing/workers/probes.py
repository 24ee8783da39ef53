"""Health probes: ``GET /health`` on every worker (a plain engine, or a worker's sidecar).

Every ``interval_s``, and at once for a worker whose stream says it is routable again while
its last probe failed (``WorkerRegistry.probe_soon``). A failed worker keeps being probed
and is back with the first 200. A refusal's reason is the worker's own when its body says one
(a sidecar's ``{"reason": ...}``), so ``/v1/workers`` shows why. Model names are learned from
a plain worker's ``/v1/models`` when the operator did not name them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import orjson

from routing.http.client import simple_request
from routing.workers.registry import Worker, WorkerKind, WorkerRegistry

__all__ = ["WorkerProber"]


class WorkerProber:
    """Probes the registry's workers and reports what they answer."""

    def __init__(
        self,
        registry: WorkerRegistry,
        *,
        timeout_s: float,
        discover_models: bool,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    ) -> None:
        self.registry = registry
        self.timeout_s = timeout_s
        self.discover_models = discover_models
        self._spawn = spawn
        self._soon: set[str] = set()  # workers with a probe on its way
        registry.probe_soon = self.probe_soon

    async def probe(self, worker: Worker) -> None:
        a = worker.address
        try:
            status, body = await simple_request(
                a.host, a.port, "GET", a.base_path + "/health", self.timeout_s
            )
            if status != 200:
                raise _RefusedError(_refusal(status, body))
            if self.discover_models and worker.kind is WorkerKind.PLAIN and not worker.models:
                status, body = await simple_request(
                    a.host, a.port, "GET", a.base_path + "/v1/models", self.timeout_s
                )
                if status == 200:
                    data = orjson.loads(body).get("data") or []
                    names = tuple(str(m["id"]) for m in data if "id" in m)
                    self.registry.learned_models(worker, names)
        except _RefusedError as exc:
            self.registry.probed(worker, False, str(exc))
        except (OSError, TimeoutError, ValueError, KeyError, AttributeError) as exc:
            self.registry.probed(worker, False, f"{type(exc).__name__}: {exc}")
        else:
            self.registry.probed(worker, True)
        finally:
            worker.last_probe_s = time.time()

    async def probe_all(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for worker in list(self.registry):
                tg.create_task(self.probe(worker))

    async def run(self, interval_s: float) -> None:
        """Probe every worker every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.probe_all()

    def probe_soon(self, worker: Worker) -> None:
        """Probe ``worker`` now (once at a time)."""
        if worker.worker_id in self._soon:
            return
        self._soon.add(worker.worker_id)
        self._spawn(self._probe_once(worker))

    async def _probe_once(self, worker: Worker) -> None:
        try:
            await self.probe(worker)
        finally:
            self._soon.discard(worker.worker_id)


class _RefusedError(Exception):
    """``/health`` answered, but not 200."""


def _refusal(status: int, body: bytes) -> str:
    """Why ``/health`` refused: the ``reason`` its JSON body gives, else the status."""
    try:
        reason = orjson.loads(body).get("reason") if body else None
    except (orjson.JSONDecodeError, AttributeError):
        reason = None
    if isinstance(reason, str) and reason:
        return reason
    return f"GET /health answered {status}"
