"""``TrtllmAdapter``: the ``EngineAdapter`` for one TensorRT-LLM server (or in-process LLM).

``trtllm-serve`` has no discovery endpoint for KV events: the block size
(``tokens_per_block``) must be given, and where the events come from is read off the
configured endpoints:

* **HTTP poll** (an ``http(s)://`` endpoint, or none: ``engine_url``): ``POST
  /kv_cache_events`` drains the engine's buffered events. With attention DP the envelopes of
  every rank arrive in one answer, each tagged ``attention_dp_rank``; an envelope from a rank
  beyond the configured endpoints is a malformed event.
* **ZMQ push** (``tcp://``, ``ipc://`` or ``inproc://`` endpoints, one per rank: TensorRT-LLM
  1.4's ``kv_cache_config.kv_events_config``): each rank's publisher is subscribed to with
  the shared ZMQ shell (``adapters.zmq_events``: sequence numbers, replay, gaps, restarts)
  and its batches decoded by ``adapters.trtllm.push``.

Either way each rank becomes one canonical worker; ``dp_size`` is the number of endpoints.

trtllm-serve's OpenAI routes take no target rank (the LLM API's
``SchedulingParams(attention_dp_rank=..., attention_dp_relax=False)`` has no HTTP field), so a
request's ``dp_rank`` cannot pin it: the engine's attention-DP balancer picks the rank, and
its KV events say which. Prefill/decode goes through ``disaggregated_params`` (``pd``,
``adapters.trtllm.pd``); ``KVSIDECAR_TRTLLM_DISAGG_AUTH_KEY`` is the engines'
``internal_request_auth_key``, for releases that authenticate the decode leg.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

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
    worker_id_for,
)
from adapters.normalize import WorkerNormalizer
from adapters.normalize_hashing import SHORT_CHAIN_BLOCKS
from adapters.normalize_metrics import AdapterMetrics
from adapters.shell import AdapterShell
from adapters.trtllm.core import Prepared, TrtRankCore, token_ids
from adapters.trtllm.pd import TrtllmPrefillDecode
from adapters.trtllm.push import TrtPushRankNormalizer
from adapters.trtllm.requests import TrtllmResponseTranslator, to_completions_request
from adapters.trtllm.sources import HttpEventSource, LlmApiEventSource
from adapters.trtllm.wire import (
    BadEnvelope,
    Envelope,
    PayloadError,
    Stored,
    decode_envelopes,
    envelopes_from_objects,
)
from adapters.zmq_events.context import close_context
from adapters.zmq_events.endpoints import is_zmq_address
from adapters.zmq_events.subscriber import RankSubscriber, subscribe_ranks
from kvcore.events import KVEvent
from kvcore.hashing import BlockHasher
from kvcore.layout import BlockLayout, LayoutKind
from kvcore.requests import TokenizedRequest

__all__ = ["AUTH_KEY_ENV", "TrtllmAdapter", "TrtllmNormalizer"]

log = structlog.get_logger(component="adapters.trtllm")
_HEAD = 64
AUTH_KEY_ENV = "KVSIDECAR_TRTLLM_DISAGG_AUTH_KEY"


class TrtllmNormalizer:
    """Raw answers (bytes or the LLM API's objects) → canonical events, for every rank."""

    def __init__(
        self,
        worker_id: str,
        model_id: str,
        block_size: int,
        dp_size: int,
        metrics: AdapterMetrics,
        *,
        lora_names: dict[int, str] | None = None,
    ) -> None:
        hasher = BlockHasher(block_size)
        self.metrics = metrics
        self.cores: list[TrtRankCore] = [
            TrtRankCore(
                WorkerNormalizer(
                    worker_id_for(worker_id, r, dp_size), model_id, hasher, metrics
                ),
                metrics,
                lora_names,
            )
            for r in range(dp_size)
        ]
        self._worker = worker_id

    def apply_payload(self, payload: bytes) -> list[KVEvent]:
        try:
            envelopes = decode_envelopes(payload)
        except PayloadError as exc:
            self.metrics.decode_errors.labels(self.metrics.engine, self._worker, "payload").inc()
            log.error(
                "kv_event_decode_failed",
                worker_id=self._worker,
                kind="payload",
                reason=str(exc),
                raw_len=len(payload),
                raw_head=payload[:_HEAD].hex(),
            )
            out: list[KVEvent] = []
            # Lost events of unknown ranks: every rank's view may have drifted.
            for core in self.cores:
                core.resync("malformed_event", out)
            return out
        return self.apply_envelopes(envelopes)

    def apply_objects(self, objects: list[Any]) -> list[KVEvent]:
        return self.apply_envelopes(envelopes_from_objects(objects))

    def apply_envelopes(self, envelopes: list[Envelope | BadEnvelope]) -> list[KVEvent]:
        out: list[KVEvent] = []
        cores = self.cores
        ranks = len(cores)
        prepared = self._prepare(envelopes)
        for env, prep in zip(envelopes, prepared, strict=True):
            rank = env.attention_dp_rank
            if not rank:
                cores[0].apply(env, out, prep)
            elif 0 < rank < ranks:
                cores[rank].apply(env, out, prep)
            else:
                raw = msgspec.json.encode(env)
                reason = f"attention_dp_rank {rank} but the adapter expects {ranks} rank(s)"
                cores[0].apply(BadEnvelope(None, None, reason, raw), out)
        for core in cores:
            core.flush_metrics()
        return out

    def _prepare(self, envelopes: list[Envelope | BadEnvelope]) -> list[Prepared | None]:
        """Token ids of every stored envelope of one answer, read once, and the block locals
        of its short chains, hashed in one vectorized pass."""
        prepared: list[Prepared | None] = [None] * len(envelopes)
        short: list[int] = []  # indices of the short stored chains
        chains: list[tuple[int, list[int]]] = []  # their (blocks, token ids)
        for i, env in enumerate(envelopes):
            if isinstance(env, BadEnvelope):
                continue
            data = env.data
            if isinstance(data, Stored):
                blocks = data.blocks
                n = len(blocks)
                ids = token_ids(blocks)
                prepared[i] = (ids, None)
                if n < SHORT_CHAIN_BLOCKS:
                    short.append(i)
                    chains.append((n, ids))
        if len(chains) > 1:
            locs = self.cores[0].normalizer.short_chain_locals(chains)
            if locs is not None:
                for i, (_, ids), loc in zip(short, chains, locs, strict=True):
                    prepared[i] = (ids, loc)
        return prepared


class TrtllmAdapter(AdapterShell):
    """KV events and request translation for one TensorRT-LLM server."""

    kind = EngineKind.TRTLLM

    def __init__(
        self,
        config: AdapterConfig,
        *,
        metrics: AdapterMetrics | None = None,
        llm: Any = None,
        environ: dict[str, str] | None = None,
        idle_probe_s: float = 1.0,
    ) -> None:
        if config.engine is not EngineKind.TRTLLM:
            raise ValueError(f"TrtllmAdapter got a config for {config.engine.value}")
        self.config = config
        self._lora_adapters = {a.name: a for a in config.lora_adapters}
        env = os.environ if environ is None else environ
        self.pd: PrefillDecode | None = TrtllmPrefillDecode(env.get(AUTH_KEY_ENV) or None)
        self.metrics = metrics if metrics is not None else AdapterMetrics("trtllm")
        self._llm = llm
        super().__init__(config.queue_size)
        self._idle_probe_s = idle_probe_s
        self.normalizer: TrtllmNormalizer | None = None  # the HTTP poll's and the LLM API's
        self.source: HttpEventSource | LlmApiEventSource | None = None
        self._ctx: zmq.asyncio.Context | None = None  # ZMQ push
        self.subscribers: list[RankSubscriber] = []

    async def start(self) -> EngineInfo:
        cfg = self.config
        if cfg.block_size is None:
            raise AdapterError(
                "TensorRT-LLM does not advertise its block size: pass --block-size "
                "(kv_cache_config tokens_per_block, 32 by default)"
            )
        endpoints = cfg.endpoints or (EventEndpoint(0, cfg.engine_url),)
        dp_size = len(endpoints)
        pushed = [is_zmq_address(ep.endpoint) for ep in endpoints]
        if any(pushed):
            if not all(pushed) or self._llm is not None:
                raise AdapterError(
                    "TensorRT-LLM's KV events come either pushed over ZMQ (tcp://, ipc:// or "
                    "inproc:// endpoints, one per rank) or polled (its HTTP URL, or the "
                    "in-process LLM API), not both: got "
                    + ", ".join(ep.endpoint for ep in endpoints)
                )
            return self._start_push(endpoints, cfg.block_size)
        norm = TrtllmNormalizer(
            cfg.worker_id,
            cfg.model_id,
            cfg.block_size,
            dp_size,
            self.metrics,
            lora_names=dict(cfg.lora_names),
        )
        self.normalizer = norm

        async def on_payload(payload: bytes) -> None:
            await self._stream.put(norm.apply_payload(payload))

        async def on_objects(objects: list[Any]) -> None:
            await self._stream.put(norm.apply_objects(objects))

        if self._llm is not None:
            self.source = LlmApiEventSource(
                self._llm, on_objects, poll_interval_s=cfg.poll_interval_s
            )
        else:
            self.source = HttpEventSource(
                endpoints[0].endpoint,
                on_payload,
                poll_interval_s=cfg.poll_interval_s,
                request_timeout_s=cfg.request_timeout_s,
                headers=cfg.engine_headers(),
            )
        worker_ids = tuple(core.normalizer.worker_id for core in norm.cores)
        self._info = EngineInfo(
            kind=self.kind,
            block_size=cfg.block_size,
            dp_size=dp_size,
            endpoints=tuple(endpoints),
            worker_ids=worker_ids,
            model_path=cfg.model_path,
        )
        self._stream.start([self.source.run])
        log.info(
            "engine_adapter_started",
            engine=self.kind.value,
            worker_ids=list(worker_ids),
            block_size=cfg.block_size,
        )
        return self._info

    def _start_push(self, endpoints: tuple[EventEndpoint, ...], block_size: int) -> EngineInfo:
        """Subscribe to every rank's ZMQ publisher (TensorRT-LLM 1.4's pushed events)."""
        cfg = self.config
        metrics = self.metrics
        self._ctx = zmq.asyncio.Context()
        self.subscribers = subscribe_ranks(
            cfg, endpoints, block_size, self._ctx, self._stream.put, metrics,
            lambda norm: TrtPushRankNormalizer(norm, metrics, cfg.lora_names),
            idle_probe_s=self._idle_probe_s,
        )
        worker_ids = tuple(sub.worker_id for sub in self.subscribers)
        self._info = EngineInfo(
            kind=self.kind,
            block_size=block_size,
            dp_size=len(endpoints),
            endpoints=tuple(endpoints),
            worker_ids=worker_ids,
            model_path=cfg.model_path,
        )
        self._stream.start([sub.run for sub in self.subscribers])
        log.info(
            "engine_adapter_started",
            engine=self.kind.value,
            worker_ids=list(worker_ids),
            block_size=block_size,
            events="zmq",
        )
        return self._info

    async def aclose(self) -> None:
        await super().aclose()
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            await close_context(ctx, owner="trtllm_adapter")

    async def kv_capacity_blocks(self) -> int | None:
        return None  # trtllm-serve does not publish its KV capacity

    async def render_tokens(self, messages: list[dict[str, Any]]) -> list[int] | None:
        return None  # trtllm-serve has no tokenize route

    def block_layout(self) -> BlockLayout:
        """The model's KV layout, ``raw``: the connector stores blocks in the engine's order."""
        return replace(self.model_layout(), kind=LayoutKind.RAW)

    def translate_request(self, request: TokenizedRequest) -> EngineRequest:
        return to_completions_request(request, self._lora_adapters)

    def response_translator(self, request: TokenizedRequest) -> TrtllmResponseTranslator:
        return TrtllmResponseTranslator(request)
