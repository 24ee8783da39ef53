"""The gateway process: its parts, the routes, and the server's life.

``Gateway`` builds the placement core, the worker registry (plain workers from the flags,
sidecar workers as they are discovered), the prompt preparer, the upstream pool and the
metrics, and hands them to the pipeline as one ``PipelineContext``. ``handle`` is called by
the HTTP layer for every parsed request, synchronously: proxied requests go to the pipeline
(``routing.pipeline.admit``); the views (``views.py``) and the gateway's own errors
(``error_replies.py``) are answered at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Coroutine, Sequence
from typing import Any
from urllib.parse import unquote

import aiohttp
import orjson

from kvcore import BlockHasher
from kvcore.control_token import CONTROL_TOKEN_HEADER, read_secret_file
from kvcore.errors import Dialect, OpenAIError
from routing.config import KvMove, LogLevel, RouterConfig
from routing.http.client import UpstreamPool
from routing.http.server import HttpRequest, ServerConnection
from routing.metrics import GatewayMetrics
from routing.pd.coordinator import PdCoordinator
from routing.pipeline.admission import AdmissionQueue, Busy
from routing.pipeline.admit import admit
from routing.pipeline.context import PipelineContext
from routing.pipeline.prefix_moves import PrefixMoves
from routing.pipeline.slo import Slo
from routing.placement.kv_router import KvRouter
from routing.placement.policies import make_policy, prediction
from routing.placement.scorer import ScoringWeights
from routing.placement.sessions import SessionAffinity
from routing.prompt.chat_template import ChatTemplate
from routing.prompt.openai_api import Endpoint
from routing.prompt.preparer import PromptPreparer
from routing.prompt.tokenizer import PromptTokenizer
from routing.replicas.durable import DurableEvents
from routing.replicas.link import ReplicaLink
from routing.replicas.shared_load import SharedLoad
from routing.serve import error_replies, views
from routing.serve.auth import Tenant
from routing.serve.indexer_routes import INDEXER_PATHS, IndexerRoutes
from routing.serve.openapi import openapi_json
from routing.serve.rate_limit import retry_after_header
from routing.serve.startup import api_keys, tls_context
from routing.workers.discovery import SidecarDiscovery
from routing.workers.k8s_discovery import K8sApiAccess, K8sPodDiscovery
from routing.workers.parity import ParityChecker
from routing.workers.probes import WorkerProber
from routing.workers.registry import Worker, WorkerRegistry

__all__ = ["Gateway"]

_ENDPOINTS = {e.value.encode(): e for e in Endpoint}
# Client headers a worker sees too: tracing and the client's identity; its credential only
# with --forward-authorization.
_FORWARDED_HEADERS = (b"traceparent", b"tracestate", b"user-agent")
_SWEEP_INTERVAL_S = 1.0
# Open with --api-key-file: liveness and scraping need no client key.
_OPEN_PATHS = frozenset((b"/health", b"/metrics"))
_MODELS_PATH = b"/v1/models/"  # + a model's name: the SDK's ``models.retrieve``


def _max_model_len(cfg: RouterConfig) -> int | None:
    if cfg.max_model_len is not None:
        return cfg.max_model_len
    if cfg.model_path is None:
        return None
    config_file = cfg.model_path / "config.json"
    if not config_file.is_file():
        return None
    value = json.loads(config_file.read_text()).get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


class Gateway:
    """One gateway: its workers, router, upstream pool, metrics and listening socket."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self._served_names = cfg.model_names  # a property of the config: read it once
        rng = random.Random(cfg.seed)
        weights = ScoringWeights(
            overlap_weight=1.0 if cfg.overlap_weight is None else cfg.overlap_weight,
            prefill_load_scale=1.0 if cfg.prefill_load_scale is None else cfg.prefill_load_scale,
            tier_weights=cfg.tier_weights,
            temperature=cfg.router_temperature,
        )
        # Sidecars publish their workers' KV events; plain workers publish none. What the
        # mode predicts overlaps from is the policy's to say.
        self.has_sidecars = bool(cfg.sidecars or cfg.sidecar_file or cfg.discover_k8s_selector)
        predict = prediction(cfg.router_mode, has_events=self.has_sidecars,
                             approx_ttl_s=cfg.approx_ttl_s)
        # With --nats the load is shared with the other replicas (routing/replicas).
        shared = None if cfg.nats_url is None else SharedLoad(cfg.block_size)
        self.router = KvRouter(
            block_size=cfg.block_size, weights=weights, rng=rng, load=shared,
            speculative_ttl_s=predict.speculative_ttl_s, use_events=predict.use_events,
            # Unless the operator fixed them, the weights follow the fleet (tuning.py).
            learn_overlap_weight=cfg.overlap_weight is None,
            learn_prefill_load_scale=cfg.prefill_load_scale is None,
            decode_interference_weight=cfg.decode_interference_weight,
            itl_target_s=cfg.slo_itl_ms / 1000,
        )
        if cfg.kv_move is KvMove.ON and self.has_sidecars:
            self.router.enable_moves()
        self.replicas = None if shared is None else ReplicaLink.for_gateway(
            cfg, self.router, shared)
        self.workers = WorkerRegistry(
            on_capacity=self.router.load.set_capacity,
            on_engine_load=self.router.load.set_engine_load,
        )
        for address in cfg.workers:
            self.workers.add(Worker(address.url, address, models=cfg.model_names))
        self.sidecars: SidecarDiscovery | None = None
        self.k8s: K8sPodDiscovery | None = None
        # In-cluster settings resolved now: a gateway outside a pod without --k8s-api-url
        # stops at once, saying so.
        self._k8s_access = (K8sApiAccess.resolve(cfg) if cfg.discover_k8s_selector else None)
        self.parity: ParityChecker | None = None
        self._session: aiohttp.ClientSession | None = None
        self.metrics = GatewayMetrics()
        self.metrics.set_gauge_source(self.workers_state)
        if self.replicas is not None:
            self.metrics.registry.register(self.replicas.metrics)
        self.durable = DurableEvents.build(cfg, self.router, self.replicas, self.metrics.registry)
        # Prefill/decode pairs; the registry's pools keep aggregated requests off them.
        self.pd: PdCoordinator | None = None
        if self.has_sidecars:
            self.pd = PdCoordinator(
                self.router,
                self.workers,
                mode=cfg.pd_mode,
                policy=cfg.kv_load_failure_policy,
                queue_timeout_s=cfg.pd_queue_timeout_s,
                transfer_timeout_s=cfg.kv_transfer_timeout_s,
                kv_transport=cfg.kv_transport.value,
            )
            self.metrics.registry.register(self.pd.metrics)
        tokenizer = template = None
        if cfg.model_path is not None:
            tokenizer = PromptTokenizer.from_model_dir(cfg.model_path,
                                                       cfg.tokenizer_cache_tokens)
            template = ChatTemplate.from_model_dir(cfg.model_path)
        policy = make_policy(cfg.router_mode, self.router, rng)
        self.prompts = PromptPreparer(
            tokenizer,
            template,
            BlockHasher(cfg.block_size),
            hash_prompts=policy.uses_prefix,
            max_model_len=_max_model_len(cfg),
        )
        self.pool = UpstreamPool(cfg.max_idle_connections_per_worker, cfg.connect_timeout_s)
        busy = Busy(cfg.max_in_flight_per_worker, cfg.busy_kv_fraction, cfg.busy_prefill_tokens)
        moves = None
        if self.router.move is not None:
            moves = PrefixMoves(self.router.move, self.workers, cfg.kv_transport.value)
            self.metrics.registry.register(moves)
        self.ctx = PipelineContext(
            router=self.router,
            policy=policy,
            prompts=self.prompts,
            workers=self.workers,
            upstream=self.pool,
            metrics=self.metrics,
            pd=self.pd,
            spawn=self.spawn,
            in_flight={},
            model_names=self.model_names,
            busy=busy if busy.any else None,
            admission=(AdmissionQueue(cfg.queue_timeout_s, cfg.queue_max, cfg.queue_order,
                                      lookahead=cfg.queue_lookahead if policy.uses_prefix
                                      else 0)
                       if cfg.queue_timeout_s > 0 and busy.any else None),
            sessions=(SessionAffinity(cfg.session_ttl_s) if cfg.session_affinity else None),
            slo=Slo(cfg.slo_ttft_ms / 1000, cfg.slo_itl_ms / 1000),
            forwarded_headers=_FORWARDED_HEADERS
            + ((b"authorization",) if cfg.forward_authorization else ()),
            log_requests=cfg.log_level is LogLevel.DEBUG,
            migration_limit=cfg.migration_limit,
            prompt_hold=None if self.replicas is None else self.replicas.hold,
            moves=moves,
        )
        self.metrics.admission = self.ctx.admission
        self.prober = WorkerProber(
            self.workers,
            timeout_s=cfg.connect_timeout_s,
            discover_models=not cfg.model_names,
            spawn=self.spawn,
        )
        self.indexer = IndexerRoutes(self.router, self.workers, self.prompts.hasher,
                                     self.model_names, cfg.xxh3_seed)
        self.auth = api_keys(cfg)
        self.sidecar_token = (
            None if cfg.sidecar_token_file is None
            else read_secret_file(cfg.sidecar_token_file, "--sidecar-token-file")
        )
        self.scheme = "http" if cfg.tls_cert is None else "https"
        self._key_prefix = os.urandom(4).hex()
        self._next_key = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None
        self._connections: set[ServerConnection] = set()
        self.port = 0
        self.started_s = time.time()
        self.draining = False

    @property
    def in_flight(self) -> int:
        return len(self.ctx.in_flight)

    # --- lifecycle -----------------------------------------------------------------------

    async def follow_workers(self) -> None:
        """Probe the workers once, then keep probing them and following the sidecars (the
        endpoint picker, ``routing.epp``, runs this without the HTTP front)."""
        if self.replicas is not None:
            self.spawn(self.replicas.run())
        if self.durable is not None:  # warm first: the feeds then resume, not resync
            await self.durable.start(self.spawn)
        await self.prober.probe_all()
        if self.has_sidecars:
            self._start_sidecars()
        self.spawn(self.prober.run(self.cfg.health_check_interval_s))

    async def start(self) -> int:
        """Follow the workers, start listening; returns the bound port."""
        await self.follow_workers()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._new_connection, self.cfg.host, self.cfg.port, backlog=4096, reuse_address=True,
            ssl=tls_context(self.cfg),
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self.spawn(self._sweep())
        return self.port

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Report unhealthy, stop accepting, give in-flight requests ``timeout_s``, then cut
        the rest."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.drain()  # idle ones close now, busy ones after their response
        deadline = time.monotonic() + timeout_s
        while self.ctx.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self._connections):
            conn.abort()
        if self.ctx.admission is not None:
            self.ctx.admission.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.pool.close_all()
        if self.k8s is not None:
            await self.k8s.aclose()
        if self.sidecars is not None:
            await self.sidecars.aclose()
        if self._session is not None:
            await self._session.close()

    def _start_sidecars(self) -> None:
        """Follow every configured sidecar: its workers join as they are discovered."""
        token = self.sidecar_token
        self._session = aiohttp.ClientSession(
            headers=None if token is None else {CONTROL_TOKEN_HEADER: token}
        )
        self.parity = ParityChecker(
            self.workers, self.prompts, self.metrics, self._session,
            model_id=self.cfg.model_names[0],
        )
        self.workers.check_parity = self._check_parity
        self.spawn(self.parity.run(self.cfg.parity_interval_s))
        self.sidecars = SidecarDiscovery(
            self.workers,
            self.router,
            self._session,
            model_id=self.cfg.model_names[0],
            models=self.cfg.model_names,
            dead_after_s=self.cfg.dead_after_s,
            control_header=b"" if token is None
            else b"%s: %s\r\n" % (CONTROL_TOKEN_HEADER.encode(), token.encode()),
            live_events=self.durable,
        )
        for address in self.cfg.sidecars:
            self.sidecars.add(address.url)
        if self.cfg.sidecar_file is not None:
            self.sidecars.watch_file(self.cfg.sidecar_file)
        if self.cfg.discover_k8s_selector is not None and self._k8s_access is not None:
            self.k8s = K8sPodDiscovery(self.sidecars, self._k8s_access,
                                       self.cfg.discover_k8s_selector, self.cfg.discover_k8s_port)
            self.metrics.registry.register(self.k8s.metrics)
            self.k8s.start()

    def _check_parity(self, worker: Worker) -> None:
        if self.parity is not None:
            self.spawn(self.parity.check(worker))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """A task owned by the gateway (cancelled on stop)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _new_connection(self) -> ServerConnection:
        conn = ServerConnection(self, self.cfg.max_body_bytes, self._connections.discard)
        self._connections.add(conn)
        return conn

    async def _sweep(self) -> None:
        timeout = self.cfg.upstream_timeout_s
        in_flight = self.ctx.in_flight
        while True:
            await asyncio.sleep(_SWEEP_INTERVAL_S)
            limit = time.monotonic() - timeout
            for request in [r for r in in_flight.values() if r.last_activity < limit]:
                request.timed_out()

    # --- routing of HTTP requests --------------------------------------------------------

    def handle(self, conn: ServerConnection, request: HttpRequest) -> None:
        path, method = request.path, request.method
        endpoint = _ENDPOINTS.get(path)
        dialect = Dialect.OPENAI if endpoint is None else endpoint.dialect
        tenant: Tenant | None = None
        if self.auth is not None and path not in _OPEN_PATHS:
            tenant = self.auth.authenticate(request.headers)
            if tenant is None:
                self.metrics.unauthorized += 1
                conn.respond(401, error_replies.UNAUTHORIZED.body(dialect),
                             extra_headers=b"www-authenticate: Bearer\r\n"
                             + self._id_header(request))
                return
        if endpoint is not None:
            if method != b"POST":
                self._plain_error(conn, request, error_replies.method_not_allowed(
                    path, method), dialect, b"allow: POST\r\n")
            elif tenant is not None and (wait_s := tenant.take_request()):
                self._rate_limited(conn, request, tenant, wait_s, dialect)
            else:
                self._next_key += 1
                key = f"{self._key_prefix}-{self._next_key}"
                request_id = request.headers.get(b"x-request-id") or self._new_request_id()
                admit(self.ctx, conn, request, endpoint, key, request_id, tenant)
            return
        if path in INDEXER_PATHS:
            self._indexer(conn, request, tenant)
            return
        if method not in (b"GET", b"HEAD"):
            self._no_route(conn, request)
        elif path == b"/health":
            code, body = views.health(self.workers, self.draining)
            conn.respond(code, body, extra_headers=self._id_header(request))
        elif path == b"/v1/models":
            body = views.models_body(self.model_names(), self.started_s,
                                     self.prompts.max_model_len)
            conn.respond(200, body, extra_headers=self._id_header(request))
        elif path.startswith(_MODELS_PATH):
            self._model_view(conn, request, path[len(_MODELS_PATH):])
        elif path == b"/v1/workers":
            conn.respond(
                200, orjson.dumps(self.workers_state()), extra_headers=self._id_header(request)
            )
        elif path == b"/metrics":
            conn.respond(200, self.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8")
        elif path == b"/openapi.json":
            body = openapi_json(tuple(self.model_names()))
            conn.respond(200, body, extra_headers=self._id_header(request))
        else:
            self._no_route(conn, request)

    def model_names(self) -> Sequence[str]:
        """The names clients may ask for: configured, or learned from the workers."""
        return self._served_names or self.workers.models()

    def _new_request_id(self) -> bytes:
        self._next_key += 1
        return b"kvs-%s-%d" % (self._key_prefix.encode(), self._next_key)

    def _id_header(self, request: HttpRequest) -> bytes:
        return b"x-request-id: %s\r\n" % (
            request.headers.get(b"x-request-id") or self._new_request_id()
        )

    def _plain_error(
        self, conn: ServerConnection, request: HttpRequest, error: OpenAIError,
        dialect: Dialect = Dialect.OPENAI, headers: bytes = b"",
    ) -> None:
        conn.respond(error.status, error.body(dialect),
                     extra_headers=headers + self._id_header(request))

    def _no_route(self, conn: ServerConnection, request: HttpRequest) -> None:
        self._plain_error(conn, request, error_replies.no_route(request.method, request.path))

    def _indexer(self, conn: ServerConnection, request: HttpRequest,
                 tenant: Tenant | None) -> None:
        """The KV indexer API (``indexer_routes``): what our index holds, for other routers."""
        if request.method != b"POST":
            self._plain_error(conn, request, error_replies.method_not_allowed(
                request.path, request.method), headers=b"allow: POST\r\n")
            return
        try:
            body = self.indexer.answer(request.path, request.body, tenant)
        except OpenAIError as exc:
            self._plain_error(conn, request, exc)
            return
        conn.respond(200, body, extra_headers=self._id_header(request))

    def _model_view(self, conn: ServerConnection, request: HttpRequest, raw: bytes) -> None:
        """``GET /v1/models/{model}``: the model object, or 404 ``model_not_found``."""
        name = unquote(raw.decode(errors="replace"))
        names = self.model_names()
        if name not in names:
            self._plain_error(conn, request, error_replies.model_not_found(name, names))
            return
        body = views.model_object(name, self.started_s, self.prompts.max_model_len)
        conn.respond(200, orjson.dumps(body), extra_headers=self._id_header(request))

    def _rate_limited(
        self, conn: ServerConnection, request: HttpRequest, tenant: Tenant, wait_s: float,
        dialect: Dialect,
    ) -> None:
        self.metrics.rate_limited += 1
        body = error_replies.rate_limited(tenant.name, wait_s).body(dialect)
        conn.respond(429, body, extra_headers=retry_after_header(wait_s) + self._id_header(request))

    # --- state views ---------------------------------------------------------------------

    def workers_state(self) -> dict[str, Any]:
        """``GET /v1/workers``: every worker, its health, load and cached blocks."""
        pending = {} if self.sidecars is None else self.sidecars.pending
        return views.workers_state(self.cfg, self.router, self.workers, self.pool,
                                   self.ctx.refusals, pending)
