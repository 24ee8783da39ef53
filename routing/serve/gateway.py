"""The gateway process: routes, request preparation (tokenize, hash), and the server's life.

``Gateway.handle`` is called by the HTTP layer for every parsed request, synchronously.
Proxied requests become an ``Exchange`` (``proxy.py``); everything else is answered at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Coroutine
from typing import Any

import aiohttp
import orjson
import structlog

from kvcore import BlockHasher
from kvcore.errors import OpenAIError
from kvcore.events import Tier
from routing.config import LogLevel, RouterConfig, WorkerAddress
from routing.pd.coordinator import PdCoordinator
from routing.pipeline.exchange import Exchange
from routing.placement.kv_router import KvRouter
from routing.placement.policies import make_policy
from routing.placement.scorer import ScoringWeights
from routing.prompt.chat_template import ChatTemplate
from routing.prompt.openai_api import Endpoint, OpenAIRequest, parse_request
from routing.prompt.preparer import PromptPreparer
from routing.prompt.tokenizer import PromptTokenizer
from routing.serve.http_server import HttpRequest, ServerConnection
from routing.serve.metrics import GatewayMetrics
from routing.serve.upstream import UpstreamPool
from routing.workers.discovery import SidecarPool, SidecarWorker
from routing.workers.registry import Worker, WorkerSet

__all__ = ["Gateway", "load_config_summary"]

log = structlog.get_logger("routing.serve.gateway").bind(component="gateway")

_ENDPOINTS = {e.value.encode(): e for e in Endpoint}
_FORWARDED_HEADERS = (b"authorization", b"traceparent", b"tracestate", b"user-agent")
_SWEEP_INTERVAL_S = 1.0
# With sidecar events a routed prefix is confirmed within milliseconds; speculation only has
# to bridge the prefill and the event's trip.
_SPECULATIVE_TTL_WITH_EVENTS_S = 2.0


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
        self.debug = cfg.log_level is LogLevel.DEBUG
        rng = random.Random(cfg.seed)
        self.workers = WorkerSet(cfg.workers, probe_timeout_s=cfg.connect_timeout_s)
        weights = ScoringWeights(
            overlap_weight=cfg.overlap_weight,
            prefill_load_scale=cfg.prefill_load_scale,
            host_weight=cfg.host_weight,
            disk_weight=cfg.disk_weight,
            temperature=cfg.router_temperature,
        )
        # Plain workers publish no KV events: recent placements are all kv mode can go by.
        # Sidecars do, and their events confirm (or refute) a placement quickly.
        has_sidecars = bool(cfg.sidecars or cfg.sidecar_file)
        ttl = _SPECULATIVE_TTL_WITH_EVENTS_S if has_sidecars else cfg.approx_ttl_s
        self.router = KvRouter(
            block_size=cfg.block_size, weights=weights, speculative_ttl_s=ttl, rng=rng
        )
        self.sidecars: SidecarPool | None = None
        self._session: aiohttp.ClientSession | None = None
        self.policy = make_policy(cfg.router_mode, self.router, rng)
        self.pool = UpstreamPool(cfg.max_idle_connections_per_worker, cfg.connect_timeout_s)
        self.metrics = GatewayMetrics()
        self.metrics.set_gauge_source(self.workers_state)
        # Prefill/decode pairs (routing/pd/coordinator.py); also keeps aggregated requests off them.
        self.pd: PdCoordinator | None = PdCoordinator(self) if has_sidecars else None
        self.exchanges: dict[str, Exchange] = {}
        tokenizer = template = None
        if cfg.model_path is not None:
            tokenizer = PromptTokenizer.from_model_dir(cfg.model_path)
            template = ChatTemplate.from_model_dir(cfg.model_path)
        self.prompts = PromptPreparer(
            tokenizer,
            template,
            BlockHasher(cfg.block_size),
            hash_prompts=self.policy.uses_prefix,
            max_model_len=_max_model_len(cfg),
        )
        self._key_prefix = os.urandom(4).hex()
        self._next_key = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None
        self._connections: set[ServerConnection] = set()
        self.port = 0
        self.started_s = time.time()
        self.draining = False

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> int:
        """Probe the workers once, start listening; returns the bound port."""
        discover = not self.cfg.model_names
        await self.workers.probe_all(discover)
        if self.cfg.sidecars or self.cfg.sidecar_file:
            self._start_sidecars()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._new_connection, self.cfg.host, self.cfg.port, backlog=4096, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self.spawn(self.workers.run_probes(self.cfg.health_check_interval_s, discover))
        self.spawn(self._sweep())
        return self.port

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Report unhealthy, stop accepting, give in-flight requests ``timeout_s``, then cut
        the rest."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        deadline = time.monotonic() + timeout_s
        while self.exchanges and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self._connections):
            conn.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.pool.close_all()
        if self.sidecars is not None:
            await self.sidecars.aclose()
        if self._session is not None:
            await self._session.close()

    def _start_sidecars(self) -> None:
        """Follow every configured sidecar: its workers join as they are discovered."""
        self._session = aiohttp.ClientSession()
        self.sidecars = SidecarPool(
            self.router,
            self._session,
            model_id=self.cfg.model_names[0],
            dead_after_s=self.cfg.dead_after_s,
            on_added=self._sidecar_worker_added,
            on_removed=lambda w: self.workers.remove(w.worker_id),
        )
        for address in self.cfg.sidecars:
            self.sidecars.add(address.url)
        if self.cfg.sidecar_file is not None:
            self.sidecars.watch_file(self.cfg.sidecar_file)

    def _sidecar_worker_added(self, sidecar_worker: SidecarWorker) -> None:
        worker = Worker(
            WorkerAddress.parse(sidecar_worker.sidecar_url),
            sidecar_worker.worker_id,
            models=self.cfg.model_names,
            kind="sidecar",
            dp_rank=sidecar_worker.dp_rank,
        )
        self.workers.add(worker)

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
        while True:
            await asyncio.sleep(_SWEEP_INTERVAL_S)
            limit = time.monotonic() - timeout
            for exchange in [e for e in self.exchanges.values() if e.last_activity < limit]:
                exchange.timed_out()

    # --- routing of HTTP requests --------------------------------------------------------

    def handle(self, conn: ServerConnection, request: HttpRequest) -> None:
        path, method = request.path, request.method
        endpoint = _ENDPOINTS.get(path)
        if endpoint is not None:
            if method != b"POST":
                self._plain_error(conn, request, 405, f"{path.decode()} takes POST")
            else:
                self._proxy(conn, request, endpoint)
            return
        if method not in (b"GET", b"HEAD"):
            self._plain_error(conn, request, 404, f"no route for {method.decode()} {path.decode()}")
        elif path == b"/health":
            healthy = len(self.workers.healthy())
            status = "draining" if self.draining else "ok" if healthy else "no healthy worker"
            body = orjson.dumps({"status": status, "healthy_workers": healthy})
            code = 200 if healthy and not self.draining else 503
            conn.respond(code, body, extra_headers=self._id_header(request))
        elif path == b"/v1/models":
            conn.respond(200, self._models_body(), extra_headers=self._id_header(request))
        elif path == b"/v1/workers":
            conn.respond(
                200, orjson.dumps(self.workers_state()), extra_headers=self._id_header(request)
            )
        elif path == b"/metrics":
            conn.respond(200, self.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8")
        else:
            self._plain_error(conn, request, 404, f"no route for GET {path.decode()}")

    def _proxy(self, conn: ServerConnection, request: HttpRequest, endpoint: Endpoint) -> None:
        t_start = time.monotonic()
        request_id = request.headers.get(b"x-request-id") or self._new_request_id()
        label = endpoint.value
        try:
            parsed = parse_request(endpoint, request.body)
            self._check_model(parsed)
            prepared = self.prompts.prepare(parsed)
        except OpenAIError as exc:
            self.metrics.count_response(label, exc.status)
            conn.respond(exc.status, exc.body(), extra_headers=b"x-request-id: %s\r\n" % request_id)
            return
        if prepared.timed:
            self.metrics.tokenized_tokens += prepared.tokenized
            self.metrics.tokenizer_cache_hit_tokens += prepared.cache_hit_tokens
        extra = b"".join(
            [b"%s: %s\r\n" % (h, v) for h in _FORWARDED_HEADERS if (v := request.headers.get(h))]
        )
        self._next_key += 1
        key = f"{self._key_prefix}-{self._next_key}"
        if self.pd is not None and self.pd.takes(prepared):
            self.pd.start(conn, key, request_id, label, parsed, prepared, t_start)
            return
        exchange = Exchange(
            self,
            conn,
            key,
            request_id,
            label,
            request.path,
            request.body if prepared.body is None else prepared.body,
            parsed,
            prepared.token_ids,
            parsed.stream,
            parsed.include_usage,
            prepared.block_hashes,
            prepared.prompt_tokens,
            extra,
            t_start,
        )
        self.exchanges[key] = exchange
        exchange.start()

    def _check_model(self, parsed: OpenAIRequest) -> None:
        names = self.cfg.model_names or self.workers.models()
        if names and parsed.model not in names:
            raise OpenAIError(
                404,
                f"the model {parsed.model!r} does not exist; this gateway serves {list(names)}",
                type_="NotFoundError",
                param="model",
                code="model_not_found",
            )

    def _new_request_id(self) -> bytes:
        self._next_key += 1
        return b"kvs-%s-%d" % (self._key_prefix.encode(), self._next_key)

    def _id_header(self, request: HttpRequest) -> bytes:
        return b"x-request-id: %s\r\n" % (
            request.headers.get(b"x-request-id") or self._new_request_id()
        )

    def _plain_error(
        self, conn: ServerConnection, request: HttpRequest, status: int, message: str
    ) -> None:
        type_ = "NotFoundError" if status == 404 else "invalid_request_error"
        body = OpenAIError(status, message, type_).body()
        conn.respond(status, body, extra_headers=self._id_header(request))

    # --- state views ---------------------------------------------------------------------

    def _models_body(self) -> bytes:
        names = self.cfg.model_names or self.workers.models()
        created = int(self.started_s)
        data = [
            {
                "id": n,
                "object": "model",
                "created": created,
                "owned_by": "kvsidecar",
                "max_model_len": self.prompts.max_model_len,
            }
            for n in names
        ]
        return orjson.dumps({"object": "list", "data": data})

    def workers_state(self) -> dict[str, Any]:
        ids = [w.worker_id for w in self.workers]
        loads = self.router.load.loads(ids, ())
        index = self.router.index
        known = set(index.worker_ids)
        out = []
        for worker, load in zip(self.workers, loads, strict=True):
            wid = worker.worker_id
            cached = {
                tier.name.lower(): index.num_blocks(wid, tier) if wid in known else 0
                for tier in Tier
            }
            feed = self.sidecars.get(wid) if self.sidecars is not None else None
            out.append(
                {
                    "worker_id": wid,
                    "url": worker.address.url,
                    "kind": worker.kind,
                    "role": feed.role if feed is not None else "agg",
                    "healthy": worker.healthy,
                    "routable": feed.routable if feed is not None else worker.healthy,
                    "reason": feed.reason if feed is not None else "",
                    "in_flight": worker.in_flight,
                    "active_blocks": load.decode_blocks,
                    "active_prefill_tokens": load.active_prefill_tokens,
                    "cached_blocks": cached,
                    "requests": worker.requests,
                    "models": list(worker.models),
                    "last_error": worker.last_error,
                    "idle_connections": self.pool.idle_count(worker.worker_id),
                }
            )
        return {"router_mode": self.cfg.router_mode.value, "workers": out}

    def log_request(self, exchange: Exchange, status: int, now: float) -> None:
        """The canonical log line of a request (debug level only)."""
        placement = exchange.placement
        log.debug(
            "request_completed",
            request_id=exchange.request_id.decode(errors="replace"),
            endpoint=exchange.endpoint,
            status=status,
            worker_id=None if placement is None else placement.worker_id,
            cached_blocks=None if placement is None else placement.overlap.longest,
            prompt_tokens=exchange.prompt_tokens,
            events=exchange.events,
            retries=len(exchange.tried),
            latency_ms=round((now - exchange.t_start) * 1e3, 3),
            ttft_ms=round((exchange.t_first - exchange.t_start) * 1e3, 3)
            if exchange.t_first
            else None,
        )


def load_config_summary(cfg: RouterConfig) -> dict[str, Any]:
    return {
        "workers": [w.url for w in cfg.workers],
        "router_mode": cfg.router_mode.value,
        "model_path": str(cfg.model_path) if cfg.model_path else None,
        "block_size": cfg.block_size,
        "max_in_flight_per_worker": cfg.max_in_flight_per_worker,
    }
