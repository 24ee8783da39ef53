"""``FakeAdapter``: an in-process ``EngineAdapter`` for the sidecar's unit tests (tests only).

It has no engine behind it: a test drives it with the same engine-neutral ops the fake
engines take (``store``/``remove``/``clear``/``restart``/``gap``/``garbage``), and it
normalizes them with the real ``WorkerNormalizer``, so it passes the same contract suite as
the real adapters. Requests are "translated" to an echo of the tokenized request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any, Self

from adapters.base import (
    AdapterError,
    EngineInfo,
    EngineKind,
    EngineRequest,
    EventEndpoint,
    PrefillDecode,
    StoreKeys,
    StoreNameSink,
)
from adapters.normalize import WorkerNormalizer
from adapters.normalize_metrics import AdapterMetrics
from adapters.normalize_openai import OpenAIBuilder, Usage
from kvcore.errors import OpenAIError
from kvcore.events import KVEvent, Tier
from kvcore.hashing import BlockHasher
from kvcore.layout import BlockLayout
from kvcore.requests import TokenizedRequest
from kvcore.stream import EngineLoad
from tests.unit.adapters.fake_engines import Truth


class _EchoTranslator:
    def __init__(self, request: TokenizedRequest) -> None:
        self.builder = OpenAIBuilder(request, created=0)

    def response(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.builder.response(str(body["text"]), "stop", Usage(0, 0))

    def chunk(self, data: Mapping[str, Any]) -> list[dict[str, Any]]:
        return [self.builder.chunk(str(data["text"]), None)]

    def finish(self) -> list[dict[str, Any]]:
        return []

    def token_ids(self) -> list[int] | None:
        return None

    def cached_tokens(self) -> int | None:
        return None

    def error(self, status: int, body: bytes) -> OpenAIError:
        return OpenAIError(status, body.decode())


class FakeAdapter:
    """One fake worker; the test is the engine."""

    kind = EngineKind.SGLANG  # it pretends to front an SGLang-like engine
    pd: PrefillDecode | None = None
    store_keys = StoreKeys.CANONICAL  # no storage hook: nothing to name

    def __init__(self, worker_id: str = "fake", model_id: str = "m", block_size: int = 4) -> None:
        self.metrics = AdapterMetrics("fake")
        self.block_size = block_size
        self.truth = Truth()
        self._norm = WorkerNormalizer(worker_id, model_id, BlockHasher(block_size), self.metrics)
        self._queue: asyncio.Queue[KVEvent | None] = asyncio.Queue()
        self._info: EngineInfo | None = None
        self.load: EngineLoad | None = None  # what engine_load answers (the test sets it)

    # --- ops (the test plays the engine) ---------------------------------------------------

    def _put(self, out: list[KVEvent]) -> None:
        self._norm.flush_metrics()
        for event in out:
            self._queue.put_nowait(event)

    async def store(
        self, hashes: list[int], parent: int | None, tokens: list[int], salt: str | None = None
    ) -> None:
        self.truth.store(hashes, parent, tokens, self.block_size)
        out: list[KVEvent] = []
        self._norm.stored(hashes, parent, tokens, Tier.GPU, out, cache_salt=salt)
        self._put(out)

    async def remove(self, hashes: list[int]) -> None:
        for h in hashes:
            self.truth.blocks.pop(h, None)
        out: list[KVEvent] = []
        self._norm.removed(hashes, Tier.GPU, out)
        self._put(out)

    async def clear(self) -> None:
        self.truth.blocks.clear()
        out: list[KVEvent] = []
        self._norm.cleared(None, out)
        self._put(out)

    async def restart(self) -> None:
        self.truth = Truth()
        out: list[KVEvent] = []
        self._norm.resync(out)
        self._put(out)

    def gap(self, n: int = 1) -> None:
        """In process nothing is lost."""

    async def garbage(self) -> None:
        self.metrics.decode_errors.labels("fake", self._norm.worker_id, "event").inc()
        out: list[KVEvent] = []
        self._norm.resync(out)
        self._put(out)
        self.truth = Truth()  # the fake forgets too, so truth and view agree

    # --- the Protocol -------------------------------------------------------------------

    async def start(self) -> EngineInfo:
        self._info = EngineInfo(
            kind=self.kind,
            block_size=self.block_size,
            dp_size=1,
            endpoints=(EventEndpoint(0, "inproc://fake"),),
            worker_ids=(self._norm.worker_id,),
        )
        return self._info

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise AdapterError("the adapter has not started")
        return self._info

    async def _iter(self) -> AsyncIterator[KVEvent]:
        while (event := await self._queue.get()) is not None:
            yield event

    def events(self) -> AsyncIterator[KVEvent]:
        return self._iter()

    async def kv_capacity_blocks(self) -> int | None:
        return None

    def engine_load(self, worker_id: str) -> EngineLoad | None:
        return self.load if worker_id == self._norm.worker_id else None

    async def render_tokens(self, messages: list[dict[str, Any]]) -> list[int] | None:
        return None

    def block_layout(self) -> BlockLayout:
        return BlockLayout(2, 2, 8, self.block_size, "float32")

    def watch_store_names(self, sink: StoreNameSink) -> None:
        return None

    def translate_request(self, request: TokenizedRequest) -> EngineRequest:
        return EngineRequest("/echo", {"input_ids": request.prompt_token_ids}, request.stream)

    def response_translator(self, request: TokenizedRequest) -> _EchoTranslator:
        return _EchoTranslator(request)

    async def aclose(self) -> None:
        self._queue.put_nowait(None)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
