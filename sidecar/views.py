"""The sidecar's read-only views: ``SidecarViews``, the base of ``app.Sidecar``.

What a sidecar says about its workers, on its stream (``WorkerStatus``, every interval) and
over HTTP: ``/health`` (routable, or why not), ``/metrics``, ``/v1/load`` (what it has in
flight, and the engine's own load reading), ``/v1/workers`` (model, block size, role, a
prefill engine's bootstrap address) and ``/v1/kv-events`` (a worker's event stream).

Kept apart from the sidecar's lifecycle (``app.py``: the order of start and stop) so that
each reads on its own; the state these views read is declared here and set by ``Sidecar``.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import generate_latest

from adapters.base import EngineAdapter
from kvcore.stream import EngineLoad, WorkerStatus
from sidecar.config import SidecarConfig
from sidecar.engine_watch import EngineWatch
from sidecar.event_stream import EventStream
from sidecar.health import SilenceDetector
from sidecar.load import LoadTracker
from sidecar.metrics import SidecarMetrics

__all__ = ["SidecarViews"]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


class SidecarViews:
    """The views of one sidecar's state (``Sidecar.__init__`` and its start set it)."""

    cfg: SidecarConfig
    streams: dict[str, EventStream]
    load: LoadTracker | None
    metrics: SidecarMetrics
    model_id: str
    block_size: int
    reasoning_parser: str | None
    draining: bool
    _adapter: EngineAdapter | None
    _engine: EngineWatch | None
    _silence: SilenceDetector
    _capacity_blocks: int | None

    @property
    def engine_healthy(self) -> bool:
        return self._engine is not None and self._engine.healthy

    def _routing_state(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        if not self.engine_healthy:
            return False, f"engine at {self.cfg.engine_url} fails its health check"
        health = self._silence.health()
        return health.routable, health.reason

    def _status(self, worker_id: str) -> WorkerStatus:
        routable, reason = self._routing_state()
        return WorkerStatus(
            worker_id,
            time.time_ns() // 1_000_000,
            routable,
            reason,
            self.cfg.role,
            self._capacity_blocks,
            self._engine_load(worker_id),
        )

    def _engine_load(self, worker_id: str) -> EngineLoad | None:
        """The engine's own load reading for the worker, when it publishes one."""
        return None if self._adapter is None else self._adapter.engine_load(worker_id)

    async def _health(self, request: web.Request) -> web.Response:
        routable, reason = self._routing_state()
        body = {
            "status": "ok" if routable else "unavailable",
            "engine_healthy": self.engine_healthy,
            # probes that timed out while the engine's output advanced (kept healthy)
            "engine_slow_probes": 0 if self._engine is None else self._engine.slow_probes,
            "routable": routable,
            "reason": reason,
            "draining": self.draining,
            "kv_events": self._silence.view(),
        }
        return _json(body, 200 if routable else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry), content_type="text/plain", charset="utf-8"
        )

    async def _load_view(self, request: web.Request) -> web.Response:
        """What this sidecar has in flight per worker (its own view: the gateway counts its
        load itself), with the worker's routing state and, when the engine publishes its
        own load, that reading (``load_source`` says which there is)."""
        assert self.load is not None
        routable, reason = self._routing_state()
        view = {}
        for w in self.streams:
            figures = self.load.figures(w)
            engine = self._engine_load(w)
            view[w] = {
                "in_flight": figures.in_flight,
                "active_blocks": self.load.active_blocks(w),
                "queued_prefill_tokens": figures.queued_prefill_tokens,
                "capacity_blocks": self._capacity_blocks,
                "routable": routable,
                "reason": reason,
                "role": self.cfg.role,
                "load_source": "sidecar" if engine is None else "engine",
                "engine_load": None if engine is None else engine.view(),
            }
        return _json(view)

    async def _workers_view(self, request: web.Request) -> web.Response:
        return _json(
            {
                "model_id": self.model_id,
                "block_size": self.block_size,
                "role": self.cfg.role,
                "workers": list(self.streams),
                "bootstrap": self._bootstrap(),
                # Where the engine serves OpenAI itself (an endpoint picker's pick; a loopback
                # host there means "this sidecar's host").
                "engine_url": self.cfg.engine_url,
                # Chats go to the engine's OpenAI server, where its parser splits the output.
                "reasoning_parser": self.reasoning_parser,
            }
        )

    async def _kv_events(self, request: web.Request) -> web.StreamResponse:
        worker_id = request.query.get("worker") or next(iter(self.streams))
        stream = self.streams.get(worker_id)
        if stream is None:
            return _json(
                {"error": f"unknown worker {worker_id!r}; known: {list(self.streams)}"}, 404
            )
        return await stream.handle(request)

    def _bootstrap(self) -> dict[str, Any] | None:
        """Where a prefill engine serves its own KV transfer (the gateway's native PD mode)."""
        pd = self._adapter.pd if self._adapter is not None else None
        if self.cfg.role != "prefill" or pd is None:
            return None
        address = pd.bootstrap_address(self.cfg.engine_url, self.cfg.disaggregation_bootstrap_port)
        return None if address is None else {"host": address[0], "port": address[1]}
