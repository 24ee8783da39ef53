"""The sidecar process: one engine replica's relay, proxy, health and metrics.

``Sidecar`` owns every component and background task, as an async context manager::

    async with Sidecar(cfg) as sidecar:    # waits for the engine, starts the adapter, serves
        await stop.wait()                  # SIGTERM / SIGINT
    # leaving: unroutable → stop accepting → drain (shutdown_timeout_s) → close subscribers
    #          → stop serving → close the adapter

HTTP surface: ``/health``, ``/metrics``, ``/v1/load``, ``/v1/workers``, ``/v1/kv-events``
(the event stream, docs/event-stream.md) and ``/v1/kvsidecar/generate`` (the
request proxy).

This is the composition root: each part lives in its own module (engine watch, host tier,
relay, proxy, prefill/decode routes); what stays here is their order of start and stop. The
views that read across them (the worker status, ``/health``, ``/v1/load``...) are its base's,
``views.SidecarViews``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import aiohttp
import structlog
from aiohttp import web

from adapters.base import (
    AdapterConfig,
    EngineAdapter,
    EngineKind,
    EventEndpoint,
    create_adapter,
)
from adapters.normalize_metrics import AdapterMetrics
from kvcore.control_token import CONTROL_TOKEN_HEADER
from kvcore.events import KVEvent
from sidecar.canary import CanaryLoop
from sidecar.config import SidecarConfig
from sidecar.control_guard import token_guard
from sidecar.disagg import PdRoutes
from sidecar.engine_watch import EngineWatch
from sidecar.event_stream import EventStream
from sidecar.health import SilenceDetector
from sidecar.host_tier import HostTier, store_names
from sidecar.jetstream_publisher import JetStreamPublisher
from sidecar.kv_move import MoveOutcome, PrefixPuller
from sidecar.load import LoadTracker
from sidecar.metrics import SidecarMetrics
from sidecar.pd_handoff import (
    make_handoff,
)
from sidecar.proxy import RequestProxy
from sidecar.relay import EventRelay
from sidecar.transfer import PullRecord
from sidecar.views import SidecarViews
from sidecar.zmq_publisher import ZmqRepublisher

__all__ = ["Sidecar"]

log = structlog.get_logger(component="sidecar")
_ENGINE_WAIT_S = 600.0
_SLOW_SHUTDOWN_STEP_S = 1.0


class Sidecar(SidecarViews):
    """Everything one sidecar runs, started and stopped in order."""

    def __init__(self, cfg: SidecarConfig, *, engine_wait_s: float = _ENGINE_WAIT_S) -> None:
        self.cfg = cfg
        self.engine_wait_s = engine_wait_s
        self.streams: dict[str, EventStream] = {}
        self.load: LoadTracker | None = None
        self.host_tier: HostTier | None = None
        self.metrics = SidecarMetrics(
            lambda: self.streams,
            lambda: self.load,
            lambda: None if self.host_tier is None else self.host_tier.store,
        )
        self.url = ""
        self.model_id = cfg.model_id or ""
        self.block_size = 0
        self.reasoning_parser: str | None = None  # the engine's, once the adapter started
        self.draining = False
        self._adapter: EngineAdapter | None = None
        self._session: aiohttp.ClientSession | None = None  # to peer sidecars
        self._engine_session: aiohttp.ClientSession | None = None  # with the engine's key
        self._engine: EngineWatch | None = None
        self._runner: web.AppRunner | None = None
        self._proxy: RequestProxy | None = None
        self._silence = SilenceDetector(cfg.silent_after_s)
        self._tasks: list[asyncio.Task[None]] = []
        self._capacity_blocks: int | None = None  # the engine's KV per worker, once it says
        self._zmq: ZmqRepublisher | None = None  # --publish-zmq

    # --- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        cfg = self.cfg
        # Peer sidecars (block pulls, handoffs) get the control token; the engine never does.
        self._session = aiohttp.ClientSession(
            headers=None if cfg.control_token is None
            else {CONTROL_TOKEN_HEADER: cfg.control_token}
        )
        engine_headers = {}
        if cfg.engine_api_key is not None:
            engine_headers["Authorization"] = f"Bearer {cfg.engine_api_key}"
        # The engine's credential goes to the engine only, never to a peer sidecar.
        self._engine_session = aiohttp.ClientSession(headers=engine_headers)
        self._engine = EngineWatch(self._engine_session, cfg.engine_url)
        try:
            await self._engine.wait(self.engine_wait_s)
            if not self.model_id:
                self.model_id = await self._engine.served_model()
            adapter = create_adapter(
                AdapterConfig(
                    engine=EngineKind(cfg.engine),
                    engine_url=cfg.engine_url,
                    worker_id=cfg.worker_id,
                    model_id=self.model_id,
                    block_size=cfg.block_size,
                    endpoints=cfg.event_endpoints(),
                    load_endpoints=self._flag_load_endpoints(),
                    model_path=cfg.model_path,
                    lora_adapters=cfg.lora_adapters,
                    api_key=cfg.engine_api_key,
                ),
                metrics=AdapterMetrics(cfg.engine, self.metrics.registry),
            )
            names = store_names(cfg, adapter)  # before start: the first blocks are named too
            info = await adapter.start()
            self._adapter = adapter
            self._silence.listening_on(_event_sources(cfg, info.endpoints))
            self.block_size = info.block_size
            self.reasoning_parser = info.reasoning_parser
            for worker_id in info.worker_ids:
                relay = EventRelay(
                    worker_id,
                    block_size=info.block_size,
                    model_id=self.model_id,
                    role=cfg.role,
                    buffer_events=cfg.replay_buffer_events,
                )
                stream = self.streams[worker_id] = EventStream(
                    relay, queue_frames=cfg.subscriber_queue_frames
                )
                stream.status = functools.partial(self._status, worker_id)
            if cfg.store_capacity_bytes:
                self.host_tier = await HostTier.start(
                    cfg, adapter, self._session, model_id=self.model_id, names=names,
                    on_event=self._on_store_event,
                    on_pull=self._on_pull,
                )
            self.load = LoadTracker(info.block_size)
            self._engine.progress = self._engine_progress
            self._proxy = RequestProxy(
                adapter,
                self._engine_session,
                self.load,
                self._silence,
                engine_url=cfg.engine_url,
                model_id=self.model_id,
                worker_ids=info.worker_ids,
                upstream_timeout_s=cfg.upstream_timeout_s,
                observe_latency=self.metrics.proxy_latency.observe,
                puller=PrefixPuller(None if self.host_tier is None else self.host_tier.transfer,
                                    on_outcome=self._on_move),
            )
            self._tasks = [] if cfg.nats_url is None else [asyncio.create_task(
                self._jetstream(cfg.nats_url).run(), name="publish_jetstream")]
            self._tasks += [
                asyncio.create_task(self._pump_events(), name="pump_events"),
                asyncio.create_task(self._report_status(), name="report_status"),
                asyncio.create_task(self._engine.run(), name="probe_engine"),
                asyncio.create_task(self._canary(adapter, info.block_size).run(),
                                    name="check_kv_events"),
            ]
            if cfg.zmq_publish.endpoint is not None:
                self._zmq = ZmqRepublisher(self.streams, cfg.zmq_publish, model_id=self.model_id,
                                           block_size=info.block_size)
                self.metrics.registry.register(self._zmq)
                self._tasks.append(asyncio.create_task(self._zmq.run(), name="publish_zmq"))
            await self._serve()
        except BaseException:
            await self._close()
            raise
        log.info(
            "sidecar_started",
            url=self.url,
            engine_url=cfg.engine_url,
            worker_ids=list(self.streams),
            block_size=self.block_size,
            model_id=self.model_id,
            role=cfg.role,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.drain()
        await self._close()

    async def drain(self) -> None:
        """Report unroutable, refuse new requests, wait for in-flight ones (bounded)."""
        self.draining = True
        if self._proxy is not None:
            self._proxy.accepting = False
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        load = self.load
        while load is not None and load.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if load is not None and load.in_flight:
            log.warning("shutdown_timeout_reached", in_flight=load.in_flight)
        log.info("sidecar_drained")

    async def _close(self) -> None:
        for stream in self.streams.values():
            stream.close()
        errors: list[Exception] = []
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            started = time.monotonic()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # gathered below, so no failure hides another
                errors.append(exc)
            _note_slow_step(task.get_name(), started)
        self._tasks = []
        if self._zmq is not None:
            self._zmq.close()  # (also when its task was cancelled before it ran)
        # Release in the reverse order of acquisition; the shared memory goes last.
        for close in (
            self._stop_serving,
            self._close_adapter,
            self._close_session,
            self._close_store,
        ):
            started = time.monotonic()
            try:
                await close()
            except Exception as exc:
                errors.append(exc)
            _note_slow_step(close.__name__.removeprefix("_"), started)
        if errors:
            raise ExceptionGroup("sidecar shutdown failed", errors)
        log.info("sidecar_stopped")

    async def _stop_serving(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _close_adapter(self) -> None:
        adapter, self._adapter = self._adapter, None
        if adapter is not None:
            await adapter.aclose()

    async def _close_store(self) -> None:
        host_tier, self.host_tier = self.host_tier, None
        if host_tier is not None:
            await host_tier.aclose()

    async def _close_session(self) -> None:
        sessions = (self._session, self._engine_session)
        self._session = self._engine_session = None
        for session in sessions:
            if session is not None:
                await session.close()

    # --- startup helpers ------------------------------------------------------------------

    def _on_pull(self, record: PullRecord) -> None:
        outcome = record.error_code or "ok"
        transport = record.transport.value
        self.metrics.transfer_bytes.labels(transport, outcome).inc(record.num_bytes)
        self.metrics.transfer_seconds.labels(transport, outcome).observe(record.seconds)

    def _on_move(self, outcome: MoveOutcome) -> None:
        self.metrics.kv_moves.labels(outcome.error or "ok").inc()

    def _on_store_event(self, event: KVEvent) -> None:
        # The host tier is shared by every DP rank of this replica.
        for stream in self.streams.values():
            stream.publish(event)

    def _canary(self, adapter: EngineAdapter, block_size: int) -> CanaryLoop:
        """Re-checks suspected KV-event silence with canary prompts (``sidecar.health``),
        while the engine is healthy and the sidecar is not draining."""
        assert self._engine_session is not None
        return CanaryLoop(
            self._silence, adapter, self._engine_session,
            engine_url=self.cfg.engine_url, model_id=self.model_id, block_size=block_size,
            timeout_s=self.cfg.upstream_timeout_s,
            may_send=lambda: self.engine_healthy and not self.draining,
        )

    def _jetstream(self, url: str) -> JetStreamPublisher:
        publisher = JetStreamPublisher(self.streams, url=url, model_id=self.model_id,
                                       max_age_s=self.cfg.events_max_age_s,
                                       max_bytes=self.cfg.events_max_bytes)
        self.metrics.registry.register(publisher.metrics)
        return publisher

    def _flag_load_endpoints(self) -> tuple[EventEndpoint, ...]:
        if not self.cfg.load_endpoint:
            return ()
        return (EventEndpoint(0, self.cfg.load_endpoint),)

    async def _serve(self) -> None:
        token = self.cfg.control_token
        app = web.Application(middlewares=[] if token is None else [token_guard(token)])
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/load", self._load_view)
        app.router.add_get("/v1/workers", self._workers_view)
        app.router.add_get("/v1/kv-events", self._kv_events)
        assert self._proxy is not None
        app.router.add_post("/v1/kvsidecar/generate", self._proxy.handle)
        app.router.add_post("/v1/kvsidecar/tokenize", self._proxy.render_tokens)
        if self.host_tier is not None:  # /v1/blocks/...: exports to and pulls from peers
            app.add_routes(self.host_tier.transfer.routes())
        app.add_routes(self._pd_routes().routes())  # /v1/kvsidecar/pd/... (sidecar/disagg.py)
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await runner.setup()
        site = web.TCPSite(runner, self.cfg.host, self.cfg.port)
        await site.start()
        self._runner = runner
        port = _bound_port(runner) or self.cfg.port
        self.url = f"http://{self.cfg.host}:{port}"
        if self.cfg.ready_file:
            ready = {"url": self.url, "worker_ids": list(self.streams),
                     "zmq_publish": None if self._zmq is None else self._zmq.endpoints}
            Path(self.cfg.ready_file).write_text(json.dumps(ready) + "\n")

    def _pd_routes(self) -> PdRoutes:
        """Prefill/decode disaggregation: the prefill and decode legs and the KV handoff."""
        adapter = self._adapter
        assert adapter is not None and self.load is not None
        assert self._session is not None and self._engine_session is not None
        transfer = None if self.host_tier is None else self.host_tier.transfer
        handoff = make_handoff(self.cfg, adapter.pd, transfer, self.model_id, self.block_size)
        return PdRoutes(
            adapter,
            self._engine_session,
            self._session,
            self.load,
            handoff,
            engine_url=self.cfg.engine_url,
            worker_ids=tuple(self.streams),
            role=self.cfg.role,
            bootstrap=self._bootstrap(),
            timeout_s=self.cfg.upstream_timeout_s,
        )

    # --- background tasks -----------------------------------------------------------------

    async def _pump_events(self) -> None:
        assert self._adapter is not None
        async for event in self._adapter.events():
            stream = self.streams.get(event.worker_id)
            if stream is None:
                log.warning("event_for_unknown_worker", worker_id=event.worker_id)
                continue
            self._publish(stream, event)

    def _publish(self, stream: EventStream, event: KVEvent) -> None:
        stream.publish(event)
        self._silence.on_event()

    def _engine_progress(self) -> int:
        """The engine's output so far: tokens relayed and KV events received (``EngineWatch``
        keeps a busy engine whose probe is slow healthy while this grows)."""
        return self._silence.num_events + (0 if self.load is None else self.load.generated)

    async def _report_status(self) -> None:
        """Every worker's status on its stream, every interval; asks the engine its KV
        capacity until it answers (the gateway's decode pool scores by it)."""
        assert self._adapter is not None
        while True:
            if self._capacity_blocks is None:
                self._capacity_blocks = await self._adapter.kv_capacity_blocks()
            await asyncio.sleep(self.cfg.load_report_interval_s)
            for worker_id, stream in self.streams.items():
                stream.broadcast(self._status(worker_id))


def _note_slow_step(step: str, started: float) -> None:
    """Log a shutdown step that took long, by name: a stop that overruns its grace period
    (and is killed) then says where it spent the time."""
    took = time.monotonic() - started
    if took > _SLOW_SHUTDOWN_STEP_S:
        log.warning("shutdown_step_slow", step=step, seconds=round(took, 3))


def _bound_port(runner: web.AppRunner) -> int | None:
    """The port the runner's first site actually bound (for ``--port 0``)."""
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return None


def _event_sources(cfg: SidecarConfig, endpoints: tuple[EventEndpoint, ...]) -> str:
    """Where the events are awaited and who chose it, for a silent verdict's reason."""
    where = ", ".join(e.endpoint for e in endpoints) or "(no endpoint)"
    if cfg.kv_events_endpoint:
        return f"{where} (the sidecar's --kv-events-endpoint: is that where the engine publishes?)"
    return f"{where} (as the engine advertised it; the sidecar's --kv-events-endpoint overrides)"
