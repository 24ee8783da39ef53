"""``VllmAdapter``: the ``EngineAdapter`` for one vLLM server (``vllm serve``).

Discovery: ``GET /kv_event_sources`` (``vllm/entrypoints/serve/instrumentator/basic.py``)
lists the enabled ZMQ publishers, one per DP rank. vLLM 0.32 answers a map from the rank
(a JSON string key) to that rank's resolved ``KVEventsConfig`` (``endpoint`` as bound, with
the rank's port offset, or the port the OS picked for ``tcp://*:0``; ``replay_endpoint`` or
null; ``topic``); a list of entries naming their ``data_parallel_rank`` (bare or wrapped in
``{"sources": [...]}``) is read too. A wildcard bind host is replaced by the engine URL's host. The
block size comes from ``/metrics`` (``vllm:cache_config_info``'s ``block_size``) unless given;
given both ways they must agree. Flags (``--kv-events-endpoint``, ``--block-size``) win over
discovery. Each DP rank becomes one canonical worker consumed by a ``RankSubscriber``.

vLLM must run with prefix caching and ``--kv-events-config
'{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",
"replay_endpoint":"tcp://*:5558"}'``. Its block hashes are seeded per process unless
``PYTHONHASHSEED`` is set or a ``sha256`` hash algorithm is chosen; the adapter re-hashes
every block canonically from its tokens, so either works here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import msgspec
import structlog
import zmq.asyncio

from adapters.base import (
    AdapterConfig,
    AdapterError,
    EngineInfo,
    EngineKind,
    EngineRequest,
    EventEndpoint,
    PrefillDecode,
)
from adapters.engine_http import NotServedError, engine_call
from adapters.normalize_metrics import AdapterMetrics
from adapters.shell import AdapterShell
from adapters.vllm.core import VllmRankNormalizer
from adapters.vllm.load import MetricsReading, parse_metrics, to_loads
from adapters.vllm.requests import VllmResponseTranslator, to_completions_request
from adapters.zmq_events.context import close_context
from adapters.zmq_events.subscriber import RankSubscriber, subscribe_ranks
from kvcore.layout import BlockLayout, LayoutKind
from kvcore.requests import TokenizedRequest
from kvcore.stream import EngineLoad

__all__ = ["VllmAdapter", "endpoints_from_sources"]

log = structlog.get_logger(component="adapters.vllm")

_WILDCARD_HOSTS = {"", "*", "0.0.0.0", "::", "[::]"}


def endpoints_from_sources(answer: Any, engine_url: str) -> tuple[EventEndpoint, ...]:
    """One endpoint per DP rank from ``/kv_event_sources``'s answer (sorted by rank)."""
    sources = answer.get("sources") if isinstance(answer, Mapping) else answer
    if isinstance(answer, Mapping) and "sources" not in answer:
        sources = _ranked(answer)
    if not isinstance(sources, list):
        raise AdapterError(f"malformed /kv_event_sources answer: {str(answer)[:200]}")
    if not sources:
        raise AdapterError(
            f"vLLM at {engine_url} publishes no KV events (/kv_event_sources is empty): "
            """start it with --kv-events-config '{"enable_kv_cache_events":true,"""
            """"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}'"""
        )
    host = urlsplit(engine_url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    try:
        endpoints = [
            EventEndpoint(
                dp_rank=int(s.get("data_parallel_rank") or 0),
                endpoint=_dialable(str(s["endpoint"]), host),
                replay_endpoint=None if not s.get("replay_endpoint")
                else _dialable(str(s["replay_endpoint"]), host),
                topic=str(s.get("topic") or ""),
            )
            for s in sources
        ]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise AdapterError(f"malformed /kv_event_sources answer: {str(answer)[:200]}") from exc
    return tuple(sorted(endpoints, key=lambda e: e.dp_rank))


def _ranked(answer: Mapping[str, Any]) -> list[Any] | None:
    """vLLM 0.32's ``{"<rank>": KVEventsConfig, ...}`` as entries naming their rank (None if
    a key is not a rank or a value not a map)."""
    try:
        return [{**config, "data_parallel_rank": int(rank)} for rank, config in answer.items()]
    except (TypeError, ValueError):
        return None


def _dialable(endpoint: str, host: str) -> str:
    """A bind address (``tcp://*:5557``) as a subscriber dials it (the engine's host)."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        return endpoint  # ipc:// and inproc:// are dialled as they are
    bind_host, colon, port = rest.rpartition(":")
    if not colon or bind_host not in _WILDCARD_HOSTS:
        return endpoint
    return f"tcp://{host}:{port}"


class VllmAdapter(AdapterShell):
    """KV events, load and request translation for one vLLM server."""

    kind = EngineKind.VLLM
    pd: PrefillDecode | None = None  # vLLM's own P/D connectors are not driven from here

    def __init__(
        self,
        config: AdapterConfig,
        *,
        metrics: AdapterMetrics | None = None,
        idle_probe_s: float = 1.0,
        load_interval_s: float = 1.0,
        load_stale_after_s: float = 5.0,
    ) -> None:
        if config.engine is not EngineKind.VLLM:
            raise ValueError(f"VllmAdapter got a config for {config.engine.value}")
        self.config = config
        self.metrics = metrics if metrics is not None else AdapterMetrics("vllm")
        self._idle_probe_s = idle_probe_s
        self._load_interval_s = load_interval_s
        self._load_stale_after_s = load_stale_after_s
        super().__init__(config.queue_size)
        self._ctx: zmq.asyncio.Context | None = None
        self.subscribers: list[RankSubscriber] = []
        self._loads: dict[str, EngineLoad] = {}
        self._loads_at = 0.0
        self._ranks: dict[int, str] = {}  # DP rank → worker id

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> EngineInfo:
        cfg = self.config
        endpoints = cfg.endpoints
        if not endpoints:
            endpoints = endpoints_from_sources(
                await engine_call(cfg, "GET", "/kv_event_sources"), cfg.engine_url
            )
        block_size = cfg.block_size
        reading = await self._scrape() if block_size is None else None
        if block_size is None:
            block_size = reading.block_size if reading is not None else None
            if block_size is None:
                raise AdapterError(
                    f"vLLM at {cfg.engine_url} does not say its block size "
                    "(no vllm:cache_config_info in /metrics): pass --block-size"
                )
        self._ctx = zmq.asyncio.Context()
        self.subscribers = subscribe_ranks(
            cfg, endpoints, block_size, self._ctx, self._stream.put, self.metrics,
            lambda norm: VllmRankNormalizer(norm, self.metrics, cfg.lora_names),
            idle_probe_s=self._idle_probe_s,
        )
        dp_size = len(endpoints)
        worker_ids = [sub.worker_id for sub in self.subscribers]
        self._ranks = {ep.dp_rank: w for ep, w in zip(endpoints, worker_ids, strict=True)}
        producers = [sub.run for sub in self.subscribers]
        producers.append(self._poll_load)
        if not cfg.endpoints:  # discovered: a restarted vLLM may publish on other ports
            producers.append(self._follow_sources)
        self._info = EngineInfo(
            kind=self.kind,
            block_size=block_size,
            dp_size=dp_size,
            endpoints=tuple(endpoints),
            worker_ids=tuple(worker_ids),
            model_path=cfg.model_path,
        )
        self._stream.start(producers)
        log.info(
            "engine_adapter_started",
            engine=self.kind.value,
            worker_ids=worker_ids,
            block_size=block_size,
        )
        return self._info

    async def aclose(self) -> None:
        await super().aclose()
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            await close_context(ctx, owner="vllm_adapter")

    async def _follow_sources(self) -> None:
        """While a rank's publisher is gone, ask ``/kv_event_sources`` again every
        ``idle_probe_s``: a vLLM started again binds new ephemeral ports (``tcp://*:0``), and
        its ranks' subscribers move there and rebuild (``RankSubscriber.move_to``)."""
        cfg = self.config
        while True:
            await asyncio.sleep(self._idle_probe_s)
            if not any(sub.peer_lost for sub in self.subscribers):
                continue
            try:
                endpoints = endpoints_from_sources(
                    await engine_call(cfg, "GET", "/kv_event_sources"), cfg.engine_url)
            except AdapterError:
                continue  # still down, or starting
            by_rank = {ep.dp_rank: ep for ep in endpoints}
            for rank, worker_id in self._ranks.items():
                sub = next(s for s in self.subscribers if s.worker_id == worker_id)
                if rank in by_rank:
                    sub.move_to(by_rank[rank])

    # --- load -------------------------------------------------------------------------------

    async def _poll_load(self) -> None:
        """Scrape the engine's load every ``load_interval_s`` until cancelled; a failed
        scrape leaves the last reading to go stale."""
        while True:
            try:
                await self.refresh_load()
            except AdapterError as exc:
                log.debug("engine_load_scrape_failed", error=str(exc))
            await asyncio.sleep(self._load_interval_s)

    async def refresh_load(self) -> None:
        """One scrape of ``/metrics`` (and ``/load`` for a single rank) into the readings."""
        reading = await self._scrape()
        server_load = None
        if len(self._ranks) == 1 and not reading.running:
            try:
                answer = await engine_call(self.config, "GET", "/load")
            except NotServedError:
                answer = None
            if isinstance(answer, Mapping) and isinstance(answer.get("server_load"), int):
                server_load = answer["server_load"]
        loads = to_loads(reading, max(self._ranks, default=0) + 1, server_load)
        self._loads = {self._ranks[r]: load for r, load in loads.items() if r in self._ranks}
        self._loads_at = time.monotonic()
        for worker in self._loads:
            self.metrics.load_readings.labels(self.metrics.engine, worker).inc()

    def engine_load(self, worker_id: str) -> EngineLoad | None:
        age_s = time.monotonic() - self._loads_at
        load = self._loads.get(worker_id)
        if load is None or age_s > self._load_stale_after_s:
            return None
        return msgspec.structs.replace(load, age_ms=int(age_s * 1000))

    async def kv_capacity_blocks(self) -> int | None:
        try:
            return (await self._scrape()).num_gpu_blocks
        except AdapterError:
            return None

    async def _scrape(self) -> MetricsReading:
        text = await engine_call(self.config, "GET", "/metrics", json=False)
        try:
            return parse_metrics(text)
        except ValueError as exc:
            raise AdapterError(f"/metrics is not a Prometheus page: {exc}") from exc

    # --- requests -----------------------------------------------------------------------------

    async def render_tokens(self, messages: list[dict[str, Any]]) -> list[int] | None:
        """vLLM's ``POST /tokenize`` with ``messages`` (rendered with the chat template, the
        generation prompt added, as a chat completion would); None without the route."""
        body = {"model": self.config.model_id, "messages": messages}
        try:
            answer = await engine_call(self.config, "POST", "/tokenize", body)
        except NotServedError:
            return None
        tokens = answer.get("tokens") if isinstance(answer, Mapping) else None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise AdapterError(f"/tokenize answered no token list: {str(answer)[:200]}")
        return tokens

    def block_layout(self) -> BlockLayout:
        """The blocks our KV connector (``adapters.vllm.connector``) stores: every layer's KV
        block in the attention backend's own order (``raw``), in the dtype vLLM serves the
        model in: a float32 checkpoint is downcast to 16 bits (bfloat16 on CPU); run vLLM
        with ``--dtype`` and give the store ``--store-block-bytes`` when that differs."""
        layout = self.model_layout()
        dtype = "bfloat16" if layout.dtype == "float32" else layout.dtype
        return replace(layout, dtype=dtype, kind=LayoutKind.RAW)

    def translate_request(self, request: TokenizedRequest) -> EngineRequest:
        return to_completions_request(request)

    def response_translator(self, request: TokenizedRequest) -> VllmResponseTranslator:
        return VllmResponseTranslator(request)

