"""The engine: one async loop that admits requests, loads prefixes from the host tier, runs
scheduler steps on the executor, writes pages through, and publishes KV events.

Owned state is built in ``__init__`` and started in ``__aenter__`` (publisher, loop task);
``__aexit__`` stops the loop and aborts what is left. Every step's events go out as one
SGLang ``KVEventBatch``. A failing step aborts only the requests in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from refengine.config import Compute, DisaggMode, EngineConfig
from refengine.executor import Executor, SimExecutor
from refengine.heartbeat import Heartbeat
from refengine.kv_events import EventRecorder
from refengine.kv_pool import KVStore, PageAllocator, SimKVStore
from refengine.page_hash import extend_storage_keys
from refengine.prefix_cache import PrefixCache
from refengine.presets import ModelConfig
from refengine.publisher import KVEventPublisher
from refengine.request import FinishReason, Phase, Request
from refengine.scheduler import Scheduler, Step
from refengine.tokenizer import ChatTokenizer

if TYPE_CHECKING:
    from refengine.model import LlamaModel
    from refengine.tiering import PageStoreClient

__all__ = ["HEALTH_CHECK_PREFIX", "Engine", "EngineStats"]

HEALTH_CHECK_PREFIX = "HEALTH_CHECK_"  # /health generations: not counted in the stats

log = structlog.get_logger(component="engine")


@dataclass(slots=True)
class EngineStats:
    requests_finished: int = 0
    prompt_tokens: int = 0
    cached_tokens_device: int = 0
    cached_tokens_storage: int = 0
    generated_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    step_failures: int = 0
    busy_s: float = 0.0
    prefill_busy_s: float = 0.0
    started: float = field(default_factory=time.monotonic)


@dataclass(slots=True, eq=False)
class _Channel:
    req: Request
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    written_pages: int = 0
    notified_tokens: int = 0  # wake the consumer only when there is a new token


class Engine:
    def __init__(
        self,
        cfg: EngineConfig,
        tokenizer: ChatTokenizer,
        model_cfg: ModelConfig,
        replica: int = 0,
        model: LlamaModel | None = None,
    ) -> None:
        cfg = cfg.with_model(model_cfg.kv_bytes_per_token)
        self.cfg = cfg
        self.replica = replica
        self.tokenizer = tokenizer
        self.model_cfg = model_cfg
        self.page_size = cfg.page_size
        self.recorder = EventRecorder(cfg.kv_events.enabled)
        self.cache = PrefixCache(cfg.page_size, PageAllocator(cfg.num_pages), self.recorder)
        self.scheduler = Scheduler(
            self.cache, cfg.chunked_prefill_size, cfg.max_running_requests,
            tokenizer.eos_token_id, mixed_chunk=cfg.enable_mixed_chunk,
            share_in_flight=cfg.share_in_flight_prefill,
        )
        # torch loads here, for a torch engine or a host tier only: a simulated engine
        # without one never imports it (seconds at every start)
        self.executor: Executor
        kv_store: KVStore
        if cfg.compute is Compute.TORCH:
            from refengine.model import LlamaModel  # noqa: PLC0415 - see above
            from refengine.torch_compute import TorchExecutor, TorchKVStore  # noqa: PLC0415

            torch_kv = TorchKVStore(model_cfg, cfg.num_pages, cfg.page_size)
            self.model = model or LlamaModel(model_cfg)
            self.executor = TorchExecutor(self.model, torch_kv, tokenizer.vocab_size)
            kv_store = torch_kv
        else:
            kv_store = SimKVStore(model_cfg, cfg.num_pages, cfg.page_size)
            bare, spaced = tokenizer.word_token_ids()
            if not bare or not spaced:  # a vocabulary without whole words: any but EOS
                bare = spaced = [t for t in range(tokenizer.vocab_size)
                                 if t != tokenizer.eos_token_id]
            self.executor = SimExecutor(cfg.timing, bare, spaced)
        self.kv_store = kv_store
        self.host: PageStoreClient | None = None
        if cfg.page_store:
            from refengine.host_tier import (  # noqa: PLC0415 - see above
                HostKVPool,
                StorageConfig,
                create_page_store,
            )
            from refengine.tiering import PageStoreClient  # noqa: PLC0415

            storage_cfg = StorageConfig(
                model_name=f"{cfg.model_name}-{model_cfg.seed}",
                extra_config=dict(cfg.hicache_extra_config),
                logical_page_size=cfg.page_size,
            )
            store = create_page_store(cfg.page_store, storage_cfg)
            pool = HostKVPool(
                cfg.hicache_host_pages, cfg.page_size, kv_store.page_numel, kv_store.dtype
            )
            self.host = PageStoreClient(store, pool, kv_store)
        self.publisher = KVEventPublisher(cfg.kv_events, replica) if cfg.kv_events.enabled else None
        self.stats = EngineStats()
        self.heartbeat = Heartbeat()  # one beat per pass of the loop: what /health reads
        self._channels: dict[str, _Channel] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._stack = contextlib.AsyncExitStack()
        self.accepting = False

    # -- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        self._wake = asyncio.Event()
        if self.publisher is not None:
            await self._stack.enter_async_context(self.publisher)
        self.recorder.cleared()  # as SGLang's radix cache reset() at start-up
        self._publish()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-loop")
        self.accepting = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.accepting = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for ch in list(self._channels.values()):
            reason = FinishReason("abort", message="engine shutting down", status_code=503)
            self._finish(ch.req, reason)
        await self._stack.aclose()

    # -- requests -----------------------------------------------------------------------------

    def submit(self, req: Request) -> _Channel:
        """Queue a request (raises ``CapacityError``/``ValueError`` if it can never run)."""
        if not self.accepting:
            raise RuntimeError("engine is not accepting requests")
        if req.rid in self._channels:
            raise ValueError(f"request id {req.rid!r} is already running")
        limit = self.model_cfg.max_position_embeddings
        if len(req.prompt) + req.params.max_new_tokens > limit:
            raise ValueError(
                f"prompt ({len(req.prompt)} tokens) plus max_new_tokens "
                f"({req.params.max_new_tokens}) exceeds the context length {limit}"
            )
        if self.cfg.disaggregation_mode is DisaggMode.PREFILL:
            req.export_pages = True
        elif self.cfg.disaggregation_mode is DisaggMode.DECODE:
            req.require_import = True
        req.arrival = time.monotonic()
        self.scheduler.add(req)
        ch = _Channel(req)
        self._channels[req.rid] = ch
        assert self._wake is not None
        self._wake.set()
        return ch

    async def generate(self, req: Request) -> AsyncGenerator[Request, None]:
        """Yield the request each time it advances; the last yield has ``finish`` set.
        Leaving the iterator early (client gone) aborts the request."""
        ch = self.submit(req)
        try:
            while True:
                await ch.changed.wait()
                ch.changed.clear()
                yield req
                if req.finish is not None:
                    return
        finally:
            if req.finish is None:
                self.abort(req.rid)

    def running_ids(self) -> list[str]:
        return list(self._channels)

    def abort(self, rid: str, message: str = "aborted by request") -> bool:
        ch = self._channels.get(rid)
        if ch is None:
            return False
        self._finish(ch.req, FinishReason("abort", message=message))
        self._publish()
        return True

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason)
        ch = self._channels.pop(req.rid, None)
        if ch is None:
            return
        ch.changed.set()
        if req.rid.startswith(HEALTH_CHECK_PREFIX):
            return
        self.stats.requests_finished += 1
        self.stats.prompt_tokens += len(req.prompt)
        self.stats.cached_tokens_device += req.cached_tokens_device
        self.stats.cached_tokens_storage += req.cached_tokens_storage
        self.stats.generated_tokens += len(req.output_ids)

    async def flush_cache(self) -> bool:
        """Drop every cached page, as SGLang's /flush_cache; refused while requests run."""
        if self.scheduler.num_running or self.scheduler.num_waiting:
            return False
        self.cache.clear()
        self._publish()
        return True

    # -- the loop -----------------------------------------------------------------------------

    def _publish(self) -> None:
        events = self.recorder.take()
        if events and self.publisher is not None:
            self.publisher.publish(events)

    def _idle(self) -> bool:
        s = self.scheduler
        return not (s.waiting or s.prefilling or s.decoding)

    @property
    def has_work(self) -> bool:
        """Requests wait or run: the loop will beat (``heartbeat``) unless it is stuck."""
        return not self._idle()

    @property
    def loop_alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            if self._idle():
                self.executor.idle()
                self._wake.clear()
                await self._wake.wait()
                continue
            touched: list[Request] = []
            try:
                for req in self.scheduler.admit():
                    await self._load_prefix(req)
                    touched.append(req)
                step = self.scheduler.next_step()
                if step is not None:
                    touched.extend(await self._run(step))
                await self._write_through(touched)
            except Exception as exc:  # one broken step must not take the engine down
                self.stats.step_failures += 1
                log.exception("engine_step_failed", replica=self.replica)
                for req in touched or [*self.scheduler.prefilling, *self.scheduler.decoding]:
                    if req.finish is None:
                        self._finish(req, FinishReason("abort", message=str(exc), status_code=500))
            self._publish()
            for req in touched:
                if req.finish is not None:
                    self._finish(req, req.finish)
                elif (ch := self._channels.get(req.rid)) is not None and len(
                    req.output_ids
                ) > ch.notified_tokens:
                    ch.notified_tokens = len(req.output_ids)
                    ch.changed.set()
            self.heartbeat.beat()
            await asyncio.sleep(0)

    async def _run(self, step: Step) -> list[Request]:
        """One step, prompt chunks and decode batch alike (a mixed step has both); the
        requests it advanced."""
        self.stats.prefill_steps += bool(step.prefill)
        self.stats.decode_steps += bool(step.decode)
        t0 = time.perf_counter()
        first, decoded = await self.executor.run(step)
        took = time.perf_counter() - t0
        self.stats.busy_s += took
        if step.prefill:  # a mixed step's whole time: the prefill is what made it longer
            self.stats.prefill_busy_s += took
        done = time.monotonic()
        for chunk, token in zip(step.prefill, first, strict=True):
            if chunk.req.phase is not Phase.PREFILL:
                continue  # aborted while the step ran
            if token is not None:
                chunk.req.first_token_time = done
            self.scheduler.complete_prefill(chunk, token)
            self._check_stop_strings(chunk.req)
        self.scheduler.complete_decode(step.decode, decoded)
        for req in step.decode:
            self._check_stop_strings(req)
        return [*(c.req for c in step.prefill), *step.decode]

    def _check_stop_strings(self, req: Request) -> None:
        if req.finish is not None or not req.params.stop or not req.output_ids:
            return
        if len(req.output_ids) < req.params.min_new_tokens:
            return
        text = self.tokenizer.decode(req.output_ids)
        for stop in req.params.stop:
            if stop and stop in text:
                self.scheduler.finish(req, FinishReason("stop", matched=stop))
                return

    async def _load_prefix(self, req: Request) -> None:
        """On a device-pool miss, load the following pages from the page store."""
        if self.host is None:
            return
        have = len(req.pages)
        last = (len(req.prompt) - 1) // self.page_size  # keep >= 1 token to compute
        if last > have:
            keys = extend_storage_keys(req, last, self.page_size)
            n = await asyncio.to_thread(self.host.count, keys[have:], keys[:have])
            if n:
                pages = self.scheduler.alloc_pages(req, n)
                loaded = await asyncio.to_thread(
                    self.host.load, keys[have : have + n], pages, keys[:have]
                )
                await self.executor.load_delay(loaded)
                if req.phase is not Phase.PREFILL:
                    return  # aborted meanwhile; its pages are already released
                self.scheduler.mark_loaded(req, loaded)
        ch = self._channels.get(req.rid)
        if ch is not None:
            ch.written_pages = req.num_computed // self.page_size
        if req.require_import and req.num_computed < last * self.page_size:
            got, want = req.num_computed // self.page_size, last
            self.scheduler.finish(
                req,
                FinishReason(
                    "abort",
                    message=f"decode role: only {got} of the prompt's {want} pages could be "
                    "imported from the page store",
                    status_code=409,
                ),
            )

    async def _write_through(self, reqs: list[Request]) -> None:
        if self.host is None:
            return
        for req in reqs:
            ch = self._channels.get(req.rid)
            if ch is None or req.phase is Phase.WAITING:
                continue
            full = req.inserted_pages
            keys = extend_storage_keys(req, full, self.page_size)
            if full > ch.written_pages:
                start = ch.written_pages
                await asyncio.to_thread(
                    self.host.write, keys[start:full], req.pages[start:full], keys[:start]
                )
                ch.written_pages = full
            if req.export_pages and req.finish is not None:
                prompt_keys = keys[: len(req.prompt) // self.page_size]
                req.exported_pages = await asyncio.to_thread(self.host.count, prompt_keys, [])

    # -- load reporting -----------------------------------------------------------------------

    def load(self) -> dict[str, Any]:
        """One ``LoadSnapshot`` (sglang/srt/managers/load_snapshot.py), core keys."""
        s = self.scheduler
        capacity = self.cfg.num_pages * self.page_size
        used = s.used_tokens()
        held = sum(r.num_tokens for r in (*s.prefilling, *s.decoding))
        uptime = max(1e-9, time.monotonic() - self.stats.started)
        prompt = max(1, self.stats.prompt_tokens)
        cached = self.stats.cached_tokens_device + self.stats.cached_tokens_storage
        return {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": s.num_running,
            "num_waiting_reqs": s.num_waiting,
            "num_waiting_uncached_tokens": s.waiting_uncached_tokens(),
            "num_used_tokens": used,
            "num_total_tokens": held,
            "num_active_tokens": held,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": capacity,
            "max_running_requests": self.cfg.max_running_requests,
            "token_usage": round(used / capacity, 4),
            "gen_throughput": round(self.stats.generated_tokens / uptime, 3),
            "cache_hit_rate": round(cached / prompt, 4),
            "utilization": round(min(1.0, self.stats.busy_s / uptime), 4),
            "total_prefill_uncached_tokens": self.stats.prompt_tokens - cached,
            "total_prefill_busy_us": int(self.stats.prefill_busy_s * 1e6),
        }


def set_torch_threads(n: int | None) -> None:
    if n:
        import torch  # noqa: PLC0415 - only where asked to (a simulated engine needs none)

        torch.set_num_threads(n)
