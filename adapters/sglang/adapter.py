"""``SGLangAdapter``: the ``EngineAdapter`` for one SGLang server.

Discovery: ``GET /server_info`` gives the ``kv_events`` block (publisher endpoints per DP
rank, replay ports, topic, block size); endpoints and block size given in the config win
over it, and a block size given both ways must agree. Each DP rank becomes one canonical
worker (``worker_id_for``) consumed by a ``RankSubscriber``.

The same block advertises the scheduler's load sockets when SGLang publishes them
(``load_endpoint_port_base``, ``load_topic``: ``--load-publish-endpoint``); a
``LoadSubscriber`` then keeps each worker's newest reading for ``engine_load``.

SGLang's HiCache backend keys a page in the sidecar's store by its page hash, which is the
hash SGLang's KV events publish for it (``hicache_keys.store_hash_of``): every chain the
normalizers store is reported to ``watch_store_names``'s sink under those store hashes, so
the store can announce its blocks canonically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

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
    StoreKeys,
    StoreNameSink,
    worker_id_for,
)
from adapters.engine_http import NotServedError, engine_call
from adapters.normalize import WorkerNormalizer
from adapters.normalize_metrics import AdapterMetrics
from adapters.sglang.core import RankNormalizer
from adapters.sglang.hicache_keys import store_hash_of
from adapters.sglang.load_feed import LoadBoard, LoadSubscriber
from adapters.sglang.pd import SGLangPrefillDecode
from adapters.sglang.requests import SGLangResponseTranslator, to_generate_request
from adapters.shell import AdapterShell
from adapters.zmq_events.context import close_context
from adapters.zmq_events.subscriber import RankSubscriber, subscribe_ranks
from kvcore.layout import BlockLayout, LayoutKind
from kvcore.requests import TokenizedRequest
from kvcore.stream import EngineLoad

__all__ = ["SGLangAdapter", "endpoints_from_server_info", "load_endpoints_from_server_info"]

log = structlog.get_logger(component="adapters.sglang")

_WILDCARD_HOSTS = {"", "*", "0.0.0.0", "::", "[::]"}


def endpoints_from_server_info(
    server_info: Mapping[str, Any], engine_url: str
) -> tuple[int, tuple[EventEndpoint, ...]]:
    """(block size, one endpoint per DP rank) from ``/server_info``'s ``kv_events`` block."""
    kv = server_info.get("kv_events")
    if not isinstance(kv, Mapping):
        raise AdapterError(
            f"SGLang at {engine_url} does not publish KV events (no kv_events in /server_info): "
            "start it with --kv-events-config "
            """'{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}'"""
        )
    try:
        host = str(kv.get("endpoint_host") or "")
        base = int(kv["endpoint_port_base"])
        block_size = int(kv["block_size"])
        dp_size = int(kv.get("dp_size") or 1)
        topic = str(kv.get("topic") or "")
        replay = kv.get("replay_endpoint_port_base")
        replay_base = int(replay) if replay is not None else None
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterError(f"malformed kv_events block in /server_info: {dict(kv)!r}") from exc
    if host in _WILDCARD_HOSTS:
        host = urlsplit(engine_url).hostname or "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
    endpoints = tuple(
        EventEndpoint(
            dp_rank=r,
            endpoint=f"tcp://{host}:{base + r}",
            replay_endpoint=None if replay_base is None else f"tcp://{host}:{replay_base + r}",
            topic=topic,
        )
        for r in range(dp_size)
    )
    return block_size, endpoints


def load_endpoints_from_server_info(
    server_info: Mapping[str, Any], engine_url: str
) -> tuple[EventEndpoint, ...]:
    """One load socket per DP rank from ``/server_info``'s ``kv_events`` block; none when
    the engine does not publish its load (or the block is not there).

    The host is always the engine URL's: SGLang binds the load range on a wildcard host
    whatever the KV endpoint's host is (``resolve_load_pub_range``), so only the host that
    reaches the engine reaches it.
    """
    kv = server_info.get("kv_events")
    if not isinstance(kv, Mapping) or kv.get("load_endpoint_port_base") is None:
        return ()
    try:
        base = int(kv["load_endpoint_port_base"])
        dp_size = int(kv.get("dp_size") or 1)
        topic = str(kv.get("load_topic") or "")
    except (TypeError, ValueError) as exc:
        raise AdapterError(f"malformed kv_events block in /server_info: {dict(kv)!r}") from exc
    if not 0 < base <= 65535 or dp_size < 1 or base + dp_size - 1 > 65535:
        raise AdapterError(f"malformed load port range in /server_info: {dict(kv)!r}")
    host = urlsplit(engine_url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return tuple(
        EventEndpoint(dp_rank=r, endpoint=f"tcp://{host}:{base + r}", topic=topic)
        for r in range(dp_size)
    )


class SGLangAdapter(AdapterShell):
    """KV events and request translation for one SGLang server."""

    kind = EngineKind.SGLANG
    pd: PrefillDecode | None = SGLangPrefillDecode()
    store_keys = StoreKeys.ENGINE  # HiCache keys a page by its hash (hicache_keys)

    def __init__(
        self,
        config: AdapterConfig,
        *,
        metrics: AdapterMetrics | None = None,
        idle_probe_s: float = 1.0,
        load_stale_after_s: float = 5.0,
    ) -> None:
        if config.engine is not EngineKind.SGLANG:
            raise ValueError(f"SGLangAdapter got a config for {config.engine.value}")
        self.config = config
        self.metrics = metrics if metrics is not None else AdapterMetrics("sglang")
        self._idle_probe_s = idle_probe_s
        super().__init__(config.queue_size)
        self._ctx: zmq.asyncio.Context | None = None
        self._normalizers: dict[str, WorkerNormalizer] = {}
        self.subscribers: list[RankSubscriber] = []
        self.load_board = LoadBoard(self.metrics, load_stale_after_s)
        self.load_subscriber: LoadSubscriber | None = None  # when the engine publishes load
        self._incremental = False
        self._store_names: StoreNameSink | None = None

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> EngineInfo:
        cfg = self.config
        server_info: dict[str, Any] = {}
        load_endpoints = cfg.load_endpoints
        if not cfg.endpoints or cfg.block_size is None:
            server_info = await self._server_info()
            block_size, endpoints = endpoints_from_server_info(server_info, cfg.engine_url)
            if cfg.block_size is not None and cfg.block_size != block_size:
                raise AdapterError(
                    f"--block-size {cfg.block_size} but SGLang publishes blocks of {block_size} "
                    "tokens (page_size * dcp_size); they must match"
                )
            if cfg.endpoints:
                endpoints = cfg.endpoints
            if not load_endpoints:
                load_endpoints = load_endpoints_from_server_info(server_info, cfg.engine_url)
            self._incremental = bool(server_info.get("incremental_streaming_output"))
        else:
            block_size, endpoints = cfg.block_size, cfg.endpoints
        dp_size = len(endpoints)
        load_ranks = _load_ranks(cfg.worker_id, endpoints, load_endpoints)
        self._ctx = zmq.asyncio.Context()

        def core(norm: WorkerNormalizer) -> RankNormalizer:
            norm.store_names = self._name_sink()
            self._normalizers[norm.worker_id] = norm
            return RankNormalizer(norm, self.metrics)

        self.subscribers = subscribe_ranks(
            cfg, endpoints, block_size, self._ctx, self._stream.put, self.metrics, core,
            idle_probe_s=self._idle_probe_s,
        )
        worker_ids = [sub.worker_id for sub in self.subscribers]
        producers = [sub.run for sub in self.subscribers]
        if load_ranks:
            try:
                self.load_subscriber = LoadSubscriber(load_ranks, self._ctx, self.load_board)
            except zmq.ZMQError as exc:
                await self.aclose()
                raise AdapterError(f"cannot subscribe to SGLang's load sockets: {exc}") from exc
            producers.append(self.load_subscriber.run)
        self._info = EngineInfo(
            kind=self.kind,
            block_size=block_size,
            dp_size=dp_size,
            endpoints=tuple(endpoints),
            worker_ids=tuple(worker_ids),
            model_path=cfg.model_path or _str_or_none(server_info.get("model_path")),
            server_info=server_info,
        )
        self._stream.start(producers)
        log.info(
            "engine_adapter_started",
            engine=self.kind.value,
            worker_ids=worker_ids,
            block_size=block_size,
            load_endpoints=[ep.endpoint for ep in load_endpoints],
        )
        return self._info

    async def aclose(self) -> None:
        await super().aclose()
        if self.load_subscriber is not None:
            self.load_subscriber.close()
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            await close_context(ctx, owner="sglang_adapter")

    def watch_store_names(self, sink: StoreNameSink) -> None:
        self._store_names = sink
        for norm in self._normalizers.values():
            norm.store_names = self._name_sink()

    def _name_sink(self) -> StoreNameSink | None:
        sink = self._store_names
        if sink is None:
            return None

        def report(engine_hashes: Sequence[int], block_hashes: Sequence[int],
                   parent: int | None) -> None:
            sink([store_hash_of(h) for h in engine_hashes], block_hashes, parent)

        return report

    def block_layout(self) -> BlockLayout:
        """The model's KV layout, in the order the HiCache backend can write a page: the
        host pool's (``hicache_mem_layout``) when SGLang names one (its MHA pools reorder
        pages into any order), else ``raw`` (the reference engine, which names none: its
        pool is opaque to the backend)."""
        layout = self.model_layout()
        server = self.info.server_info
        mem_layout = str(server.get("hicache_mem_layout") or "")
        kind = LayoutKind.RAW
        if mem_layout.startswith("page_first"):
            kind = LayoutKind.PAGE_FIRST
        elif mem_layout == "layer_first":
            kind = LayoutKind.LAYER_FIRST
        return BlockLayout(
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
            layout.block_size,
            layout.dtype,
            kind,
        )

    async def kv_capacity_blocks(self) -> int | None:
        try:
            info = await self._server_info()
        except AdapterError:
            return None
        tokens = info.get("max_total_num_tokens")  # per DP rank
        block = self._info.block_size if self._info is not None else info.get("page_size")
        if isinstance(tokens, int) and isinstance(block, int) and tokens > 0 and block > 0:
            return tokens // block
        return None

    def engine_load(self, worker_id: str) -> EngineLoad | None:
        return self.load_board.get(worker_id)

    def translate_request(self, request: TokenizedRequest) -> EngineRequest:
        return to_generate_request(request)

    def response_translator(self, request: TokenizedRequest) -> SGLangResponseTranslator:
        return SGLangResponseTranslator(request, incremental=self._incremental)

    async def render_tokens(self, messages: list[dict[str, Any]]) -> list[int] | None:
        """SGLang's ``POST /v1/tokenize`` with ``messages`` (0.5.23 renders them as a chat
        completion would); None from an SGLang without it (404)."""
        body = {"model": self.config.model_id, "messages": messages}
        try:
            answer = await self._call("POST", "/v1/tokenize", body)
        except NotServedError:
            return None
        tokens = answer.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise AdapterError(f"/v1/tokenize answered no token list: {str(answer)[:200]}")
        return tokens

    # --- helpers --------------------------------------------------------------------------

    async def _server_info(self) -> dict[str, Any]:
        return await self._call("GET", "/server_info")

    async def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """One JSON request to SGLang, with its API key; ``AdapterError`` on any failure."""
        answer = await engine_call(self.config, method, path, body)
        if not isinstance(answer, dict):
            raise AdapterError(f"{method} {path} did not answer a JSON object")
        return answer


def _load_ranks(
    base: str, endpoints: Sequence[EventEndpoint], load_endpoints: Sequence[EventEndpoint]
) -> list[tuple[str, EventEndpoint]]:
    """Each load endpoint with the worker its DP rank is (``AdapterError`` for a rank that
    publishes no KV events, or an address ZMQ cannot dial)."""
    workers = {ep.dp_rank: worker_id_for(base, ep.dp_rank, len(endpoints)) for ep in endpoints}
    unknown = sorted(ep.dp_rank for ep in load_endpoints if ep.dp_rank not in workers)
    if unknown:
        raise AdapterError(
            f"load endpoints for DP ranks {unknown}, which publish no KV events "
            f"(ranks {sorted(workers)} do)"
        )
    for ep in load_endpoints:
        if not ep.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise AdapterError(f"load endpoint {ep.endpoint!r} is not a ZMQ address")
    return [(workers[ep.dp_rank], ep) for ep in load_endpoints]


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
