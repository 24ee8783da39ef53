"""Adapter set-up: discovery from /server_info, config checks, the registry, lazy extras."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from adapters.base import (
    ADAPTERS,
    AdapterConfig,
    AdapterError,
    EngineKind,
    EventEndpoint,
    create_adapter,
    worker_id_for,
)
from adapters.normalize_metrics import AdapterMetrics
from adapters.sglang.adapter import SGLangAdapter, endpoints_from_server_info
from adapters.sglang.core import BlockSizeMismatchError
from adapters.trtllm.adapter import TrtllmAdapter
from adapters.trtllm.sources import LlmApiEventSource, require_tensorrt_llm
from adapters.vllm.adapter import VllmAdapter
from kvcore.events import AllBlocksCleared, BlockStored, Tier
from kvcore.extras import MissingExtraError
from kvcore.requests import RequestKind, TokenizedRequest
from tests.unit.adapters import trtllm_fixtures as trt
from tests.unit.adapters.fake_engines import FakeSGLangPublisher, FakeTrtllmServer

KV_EVENTS = {
    "publisher": "zmq",
    "endpoint_host": "*",
    "endpoint_port_base": 5557,
    "topic": "kv",
    "block_size": 16,
    "dp_size": 2,
    "replay_endpoint_port_base": 5600,
}


async def serve_info(info: dict[str, Any]) -> tuple[web.AppRunner, str]:
    """A fake SGLang HTTP front (engine boundary) answering /server_info."""

    async def handler(request: web.Request) -> web.Response:
        return web.json_response(info)

    app = web.Application()
    app.router.add_get("/server_info", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_endpoints_from_server_info_substitute_the_worker_host() -> None:
    """Wildcard hosts become the engine URL's host; ranks offset both port bases."""
    bs, eps = endpoints_from_server_info({"kv_events": KV_EVENTS}, "http://10.0.0.7:30000")
    assert bs == 16
    assert eps == (
        EventEndpoint(0, "tcp://10.0.0.7:5557", "tcp://10.0.0.7:5600", "kv"),
        EventEndpoint(1, "tcp://10.0.0.7:5558", "tcp://10.0.0.7:5601", "kv"),
    )
    no_replay = {k: v for k, v in KV_EVENTS.items() if k != "replay_endpoint_port_base"}
    _, eps = endpoints_from_server_info({"kv_events": no_replay | {"dp_size": 1}}, "http://h:1")
    assert eps[0].replay_endpoint is None


@pytest.mark.parametrize(
    ("info", "match"),
    [({"kv_events": None}, "--kv-events-config"), ({"kv_events": {"x": 1}}, "malformed")],
)
def test_server_info_without_usable_kv_events(info: dict, match: str) -> None:
    """No (or a broken) kv_events block is a clear AdapterError naming the fix."""
    with pytest.raises(AdapterError, match=match):
        endpoints_from_server_info(info, "http://h:1")


async def test_sglang_adapter_discovers_through_server_info() -> None:
    """start() reads /server_info: block size, one worker per DP rank, endpoints."""
    runner, url = await serve_info({"kv_events": KV_EVENTS, "model_path": "/nonexistent"})
    try:
        cfg = AdapterConfig(EngineKind.SGLANG, url, "r0", "m", replay_timeout_s=0.1)
        async with SGLangAdapter(cfg) as adapter:
            info = adapter.info
            assert info.block_size == 16 and info.dp_size == 2
            assert info.worker_ids == ("r0/dp0", "r0/dp1")
            assert info.endpoints[1].endpoint == "tcp://127.0.0.1:5558"
            with pytest.raises(AdapterError, match="--model-path"):
                adapter.block_layout()
        bad = AdapterConfig(EngineKind.SGLANG, url, "r0", "m", block_size=32)
        with pytest.raises(AdapterError, match="must match"):
            await SGLangAdapter(bad).start()
    finally:
        await runner.cleanup()


async def test_unreachable_engine_is_a_clear_error() -> None:
    """An engine that does not answer /server_info fails start() with the URL in the message."""
    runner, url = await serve_info({})
    await runner.cleanup()  # nothing listens there now
    cfg = AdapterConfig(EngineKind.SGLANG, url, "r0", "m", request_timeout_s=2.0)
    with pytest.raises(AdapterError, match="cannot reach SGLang"):
        await SGLangAdapter(cfg).start()


async def test_block_size_mismatch_in_events_ends_the_stream_with_the_reason() -> None:
    """Events of another block size stop the adapter loudly instead of hashing garbage."""
    engine = FakeSGLangPublisher(block_size=8)
    try:
        cfg = AdapterConfig(
            EngineKind.SGLANG,
            "http://127.0.0.1:9",
            "w",
            "m",
            block_size=4,
            endpoints=(EventEndpoint(0, engine.endpoint, engine.replay_endpoint),),
        )
        async with SGLangAdapter(cfg, idle_probe_s=0.05) as adapter:
            await engine.store([1], None, list(range(8)))
            with pytest.raises(BlockSizeMismatchError, match="--block-size 8"):
                async with asyncio.timeout(10):
                    async for _ in adapter.events():
                        pass
    finally:
        await engine.aclose()


def test_config_validation() -> None:
    """Bad configs fail at construction with the field named."""
    with pytest.raises(ValueError, match="block_size"):
        AdapterConfig(EngineKind.SGLANG, "http://h", "w", "m", block_size=0)
    with pytest.raises(ValueError, match="dp_rank"):
        AdapterConfig(
            EngineKind.SGLANG,
            "http://h",
            "w",
            "m",
            endpoints=(EventEndpoint(0, "tcp://a:1"), EventEndpoint(0, "tcp://a:2")),
        )
    with pytest.raises(ValueError, match="TrtllmAdapter"):
        TrtllmAdapter(AdapterConfig(EngineKind.SGLANG, "http://h", "w", "m"))


async def test_trtllm_needs_a_block_size() -> None:
    """trtllm-serve does not advertise tokens_per_block: starting without one says so."""
    with pytest.raises(AdapterError, match="--block-size"):
        await TrtllmAdapter(AdapterConfig(EngineKind.TRTLLM, "http://h", "w", "m")).start()


def test_registry_builds_each_adapter_by_name() -> None:
    """ADAPTERS maps engine names to factories; create_adapter imports only the one asked."""
    assert set(ADAPTERS) == {"sglang", "trtllm", "vllm"}
    sg = create_adapter(AdapterConfig(EngineKind.SGLANG, "http://h", "w", "m"))
    trt_adapter = create_adapter(AdapterConfig(EngineKind.TRTLLM, "http://h", "w", "m"))
    vl = create_adapter(AdapterConfig(EngineKind.VLLM, "http://h", "w", "m"))
    assert isinstance(sg, SGLangAdapter) and isinstance(trt_adapter, TrtllmAdapter)
    assert isinstance(vl, VllmAdapter)
    assert worker_id_for("r", 0, 1) == "r" and worker_id_for("r", 3, 4) == "r/dp3"
    req = TokenizedRequest(request_id="x", model="m", kind=RequestKind.CHAT, prompt_token_ids=[1])
    assert sg.translate_request(req).path == "/generate"
    assert trt_adapter.translate_request(req).path == "/v1/completions"
    assert vl.translate_request(req).path == "/v1/completions"


def test_tensorrt_llm_is_imported_lazily_with_a_clear_message() -> None:
    """Nothing imports tensorrt_llm at load; asking for it names the trtllm extra."""
    assert "tensorrt_llm" not in sys.modules
    if "tensorrt_llm" in sys.modules or _importable("tensorrt_llm"):
        pytest.skip("tensorrt_llm is installed here")
    with pytest.raises(MissingExtraError, match=r"kvsidecar\[trtllm\]"):
        require_tensorrt_llm()


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


class FakeLlm:
    """The LLM API's event drain (engine boundary): an async iterator that ends in IndexError."""

    def __init__(self) -> None:
        self.queue: list[dict] = [
            trt.envelope(0, trt.created()),
            trt.envelope(1, trt.stored(None, [trt.block(5, [1, 2, 3, 4])])),
        ]

    def get_kv_cache_events_async(self, timeout: float | None = None) -> AsyncIterator[dict]:
        async def drain() -> AsyncIterator[dict]:
            while self.queue:
                yield self.queue.pop(0)
            raise IndexError("queue empty")

        return drain()


async def test_llm_api_source_feeds_the_same_normalizer() -> None:
    """In-process events (get_kv_cache_events_async) normalize like the HTTP ones."""
    llm = FakeLlm()
    cfg = AdapterConfig(EngineKind.TRTLLM, "inproc", "w", "m", block_size=4)
    async with TrtllmAdapter(cfg, llm=llm) as adapter:
        async with asyncio.timeout(10):
            event = await anext(aiter(adapter.events()))
        assert isinstance(event, BlockStored) and event.token_ids == [1, 2, 3, 4]
    with pytest.raises(TypeError, match="get_kv_cache_events_async"):
        LlmApiEventSource(object(), lambda objs: asyncio.sleep(0))  # type: ignore[arg-type]
    assert msgspec.json.encode(llm.queue) == b"[]"


async def test_replay_that_never_answers_ends_in_a_resync() -> None:
    """A silent replay socket times out: the gap becomes a resync, live events go on."""
    engine = FakeSGLangPublisher(block_size=4)
    engine._server.cancel()  # the ROUTER stays bound but nobody answers it
    metrics = AdapterMetrics("sglang")
    try:
        cfg = AdapterConfig(
            EngineKind.SGLANG,
            "http://127.0.0.1:9",
            "w",
            "m",
            block_size=4,
            endpoints=(EventEndpoint(0, engine.endpoint, engine.replay_endpoint),),
            replay_timeout_s=0.2,
        )
        async with SGLangAdapter(cfg, metrics=metrics, idle_probe_s=5.0) as adapter:
            async with asyncio.timeout(10):
                await adapter.subscribers[0].connected.wait()
            stream = aiter(adapter.events())
            await engine.store([1], None, [1, 2, 3, 4])
            async with asyncio.timeout(10):
                first = await anext(stream)
            engine.gap(1)
            await engine.store([2], None, [5, 6, 7, 8])
            await engine.store([3], None, [9, 9, 9, 9])
            async with asyncio.timeout(10):
                rest = [await anext(stream), await anext(stream)]
        assert isinstance(first, BlockStored) and first.token_ids == [1, 2, 3, 4]
        assert isinstance(rest[0], AllBlocksCleared) and rest[0].tier is Tier.GPU
        assert isinstance(rest[1], BlockStored) and rest[1].token_ids == [9, 9, 9, 9]
        assert metrics.value("replays", worker="w", outcome="timeout") >= 1
        assert metrics.value("resyncs", worker="w", reason="gap_unfillable") == 1
    finally:
        await engine.aclose()


async def test_trtllm_poller_survives_engine_errors_and_drains_once() -> None:
    """Failed polls are logged once and retried; queued events then arrive, each once."""
    engine = FakeTrtllmServer(block_size=4)
    await engine.start()
    engine.fail_polls = 3
    cfg = AdapterConfig(
        EngineKind.TRTLLM, engine.url, "w", "m", block_size=4, poll_interval_s=0.01
    )
    try:
        with capture_logs() as logs:
            async with TrtllmAdapter(cfg) as adapter:
                await engine.store([1], None, [1, 2, 3, 4])
                await engine.store([2], 1, [5, 6, 7, 8])
                stream = aiter(adapter.events())
                async with asyncio.timeout(10):
                    got = [await anext(stream), await anext(stream)]
                await engine.store([3], 2, [9, 9, 9, 9])
                async with asyncio.timeout(10):
                    got.append(await anext(stream))
        assert [e.token_ids for e in got] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
        assert engine.fail_polls == 0 and engine.queue == []
        failures = [entry for entry in logs if entry["event"] == "kv_event_poll_failed"]
        assert len(failures) == 1
        assert any(entry["event"] == "kv_event_poll_recovered" for entry in logs)
    finally:
        await engine.aclose()
