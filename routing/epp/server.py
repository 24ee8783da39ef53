"""The endpoint picker's process: the gateway's parts, the ext_proc and health services on
the gRPC port, and the gateway's views (``/health``, ``/metrics``, ``/v1/workers``,
``/v1/models``) on the HTTP port.

Health (``grpc.health.v1.Health``, the endpoint-picker protocol's three services):
``liveness`` is SERVING while the process answers; ``readiness``,
``envoy.service.ext_proc.v3.ExternalProcessor`` and the overall service ("") are SERVING
once the picker knows its workers, NOT_SERVING before and while it stops. A picker that
knows its workers but has none ready still serves: it answers each request 503, as the
protocol asks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvcore.errors import UNKNOWN_ENDPOINT, OpenAIError
from routing.epp.config import EppConfig
from routing.epp.deps import Protos
from routing.epp.picker import EndpointPicker
from routing.epp.stream import PickStream
from routing.http.server import HttpRequest, ServerConnection
from routing.serve.gateway import Gateway

__all__ = ["EppServer"]

log = structlog.get_logger("routing.epp", component="epp")
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)
_HEALTH_INTERVAL_S = 0.25


class EppServer:
    """One endpoint picker: started with ``start``, stopped with ``stop``."""

    def __init__(self, cfg: EppConfig, protos: Protos) -> None:
        self.cfg = cfg
        self._p = protos
        self.gateway = Gateway(cfg.router)
        self.picker = EndpointPicker(self.gateway)
        self.outcomes: dict[str, int] = {}
        self.streams = 0
        self.gateway.metrics.registry.register(_Collector(self))
        self._grpc: Any = None
        self._health: Any = None
        self._http: asyncio.Server | None = None
        self._connections: set[ServerConnection] = set()
        self._ready: bool | None = None
        self.grpc_port = 0
        self.http_port = 0

    async def start(self) -> None:
        p, cfg = self._p, self.cfg
        await self.gateway.follow_workers()
        self._grpc = p.aio.server()
        p.ext_proc_grpc.add_ExternalProcessorServicer_to_server(_Processor(self), self._grpc)
        self._health = p.health.aio.HealthServicer()
        p.health_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        serving = p.health_pb2.HealthCheckResponse.SERVING
        await self._health.set("liveness", serving)
        await self._set_ready(self.picker.ready)
        self.grpc_port = self._grpc.add_insecure_port(f"{cfg.grpc_host}:{cfg.grpc_port}")
        if not self.grpc_port:
            raise OSError(f"cannot listen for gRPC on {cfg.grpc_host}:{cfg.grpc_port}")
        await self._grpc.start()
        loop = asyncio.get_running_loop()
        router = cfg.router
        self._http = await loop.create_server(
            self._new_connection, router.host, router.port, reuse_address=True
        )
        self.http_port = self._http.sockets[0].getsockname()[1]
        self.gateway.spawn(self._follow_health())

    async def stop(self, grace_s: float = 5.0) -> None:
        """NOT_SERVING, then the gRPC server drains its streams for ``grace_s``; the parts
        stop last."""
        errors: list[Exception] = []
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._grpc is not None:
            try:
                await self._grpc.stop(grace_s)
            except Exception as exc:  # gathered: the rest still stops
                errors.append(exc)
        if self._http is not None:
            self._http.close()
        for conn in list(self._connections):
            conn.abort()
        for pick in list(self.picker.in_flight.values()):
            pick.finish()
        try:
            await self.gateway.stop(timeout_s=0.0)
        except Exception as exc:
            errors.append(exc)
        if errors:
            raise ExceptionGroup("endpoint picker shutdown failed", errors)

    async def _follow_health(self) -> None:
        while True:
            await self._set_ready(self.picker.ready)
            await asyncio.sleep(_HEALTH_INTERVAL_S)

    async def _set_ready(self, ready: bool) -> None:
        if ready == self._ready:
            return
        self._ready = ready
        codes = self._p.health_pb2.HealthCheckResponse
        status = codes.SERVING if ready else codes.NOT_SERVING
        for service in _READY_SERVICES:
            await self._health.set(service, status)
        log.info("epp_readiness_changed", ready=ready, workers=len(self.gateway.workers))

    # --- ext_proc ---------------------------------------------------------------------------

    async def process(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """One ``Process`` stream."""
        router = self.cfg.router
        stream = PickStream(self.picker, self._p, self.cfg.body_mode, router.max_body_bytes,
                            self.outcomes)
        self.streams += 1
        try:
            async for req in requests:
                for resp in stream.on_message(req):
                    yield resp
                if stream.ended:
                    return
        finally:
            self.streams -= 1
            stream.close()

    # --- HTTP views ---------------------------------------------------------------------

    def _new_connection(self) -> ServerConnection:
        conn = ServerConnection(self, 1 << 16, self._connections.discard)
        self._connections.add(conn)
        return conn

    def handle(self, conn: ServerConnection, request: HttpRequest) -> None:
        """The gateway's views; nothing is proxied here."""
        if request.method in (b"GET", b"HEAD"):
            self.gateway.handle(conn, request)
            return
        message = (
            "the endpoint picker proxies no request: Envoy asks it over ext_proc (gRPC port "
            f"{self.grpc_port}) and sends the request to the engine it picks"
        )
        conn.respond(404, OpenAIError(404, message, code=UNKNOWN_ENDPOINT).body())


class _Processor:
    """``envoy.service.ext_proc.v3.ExternalProcessor``."""

    def __init__(self, server: EppServer) -> None:
        self._server = server

    async def Process(  # gRPC's name; an async generator, as grpc.aio streams answers
        self, request_iterator: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Any]:
        async for response in self._server.process(request_iterator):
            yield response


class _Collector:
    def __init__(self, server: EppServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        s = self._server
        outcomes = CounterMetricFamily(
            "kvsidecar_epp_picks",
            "ext_proc requests by outcome: picked, or the status of the immediate response",
            labels=["outcome"],
        )
        for outcome, count in sorted(s.outcomes.items()):
            outcomes.add_metric([outcome], count)
        yield outcomes
        yield GaugeMetricFamily("kvsidecar_epp_streams", "ext_proc streams open",
                                value=s.streams)
        yield GaugeMetricFamily("kvsidecar_epp_routable_endpoints",
                                "endpoints a request may be picked for now",
                                value=len(s.picker.routable_endpoints()))
