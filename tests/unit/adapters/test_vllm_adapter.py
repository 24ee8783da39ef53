"""The vLLM adapter's discovery, load and requests (no engine: its answers as vLLM gives them),
and its event stream against a vLLM publisher played on real loopback sockets: a gap filled
from the replay socket, a seq restart resynced, duplicate stores and removals counted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from adapters.base import AdapterConfig, AdapterError, EngineKind, EventEndpoint
from adapters.normalize_metrics import AdapterMetrics
from adapters.vllm.adapter import VllmAdapter, endpoints_from_sources
from adapters.vllm.load import parse_metrics, to_loads
from adapters.vllm.requests import DP_RANK_HEADER, VllmResponseTranslator, to_completions_request
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kvcore.hashing import BlockHasher
from kvcore.namespace import Namespace
from kvcore.requests import RequestKind, TokenizedRequest
from kvcore.stream import EngineLoad
from tests.unit.adapters.fake_engines import FakeVllmPublisher

BS = 4
DEADLINE_S = 10.0

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="100"} 1.0
"""


def test_sources_are_dialled_on_the_engines_host() -> None:
    """Both answer shapes; a wildcard bind host becomes the engine URL's host."""
    sources = [
        {"data_parallel_rank": 1, "endpoint": "tcp://*:5558", "replay_endpoint": None,
         "topic": "kv"},
        {"data_parallel_rank": 0, "endpoint": "tcp://0.0.0.0:5557",
         "replay_endpoint": "tcp://10.0.0.2:5600", "topic": "kv"},
    ]
    for answer in (sources, {"sources": sources}):
        got = endpoints_from_sources(answer, "http://engine-a:8000")
        assert got == (
            EventEndpoint(0, "tcp://engine-a:5557", "tcp://10.0.0.2:5600", "kv"),
            EventEndpoint(1, "tcp://engine-a:5558", None, "kv"),
        )


def test_vllm_032_answers_a_map_keyed_by_rank() -> None:
    """vLLM 0.32's ``{"<rank>": KVEventsConfig}`` (as a real engine answered); ``{}`` says no
    publisher, with how to start one."""
    answer = {
        "0": {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": "tcp://127.0.0.1:41001", "replay_endpoint": "tcp://127.0.0.1:41002",
              "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": ""},
        "1": {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": "tcp://*:5558", "replay_endpoint": None, "topic": ""},
    }
    assert endpoints_from_sources(answer, "http://127.0.0.1:8000") == (
        EventEndpoint(0, "tcp://127.0.0.1:41001", "tcp://127.0.0.1:41002", ""),
        EventEndpoint(1, "tcp://127.0.0.1:5558", None, ""),
    )
    with pytest.raises(AdapterError, match="--kv-events-config"):
        endpoints_from_sources({}, "http://127.0.0.1:8000")


def test_metrics_give_each_ranks_load_and_the_pool() -> None:
    reading = parse_metrics(METRICS)
    assert (reading.block_size, reading.num_gpu_blocks) == (32, 100)
    loads = to_loads(reading, 2)
    assert loads[0] == EngineLoad(3, 2, 800, 3200)
    assert loads[1] == EngineLoad(1, 0, 1600, 3200)
    assert to_loads(parse_metrics(""), 1, server_load=4) == {0: EngineLoad(4, 0, 0, None)}


def test_requests_go_as_token_ids_to_completions() -> None:
    """Salt, priority, LoRA (as the model) and the DP rank (a header) reach vLLM."""
    req = TokenizedRequest(
        request_id="r", model="m", kind=RequestKind.CHAT, prompt_token_ids=[1, 2],
        max_tokens=5, cache_salt="s", lora_name="ad", priority=2, dp_rank=1, stream=True,
    )
    native = to_completions_request(req)
    assert native.path == "/v1/completions" and native.headers == {DP_RANK_HEADER: "1"}
    assert native.body["prompt"] == [1, 2] and native.body["model"] == "ad"
    assert (native.body["cache_salt"], native.body["priority"]) == ("s", 2)
    assert native.body["return_token_ids"] is True
    tr = VllmResponseTranslator(req)
    usage = {"prompt_tokens": 2, "completion_tokens": 1,
             "prompt_tokens_details": {"cached_tokens": 0}}
    assert tr.chunk({"choices": [{"text": "Hi", "token_ids": [7], "finish_reason": None}]})
    assert tr.chunk({"choices": [], "usage": usage}) == []
    assert tr.token_ids() == [7] and tr.cached_tokens() == 0


# --- the event stream over real sockets ---------------------------------------------------------


@pytest.fixture
async def stream() -> AsyncIterator[tuple[FakeVllmPublisher, VllmAdapter, AsyncIterator[KVEvent]]]:
    engine = FakeVllmPublisher(BS, topic=b"kv")
    cfg = AdapterConfig(
        EngineKind.VLLM, "http://127.0.0.1:9", "w", "m", block_size=BS,
        endpoints=(EventEndpoint(0, engine.endpoint, engine.replay_endpoint, "kv"),),
    )
    adapter = VllmAdapter(cfg, metrics=AdapterMetrics("vllm"), idle_probe_s=0.05)
    await adapter.start()
    try:
        async with asyncio.timeout(DEADLINE_S):
            await adapter.subscribers[0].connected.wait()
        yield engine, adapter, aiter(adapter.events())
    finally:
        await adapter.aclose()
        await engine.aclose()


async def take(events: AsyncIterator[KVEvent], n: int) -> list[KVEvent]:
    async with asyncio.timeout(DEADLINE_S):
        return [await anext(events) for _ in range(n)]


def h(tokens: list[int]) -> list[int]:
    return BlockHasher(BS).hash_tokens(tokens, Namespace("m", None, None).seed)


async def test_gap_restart_and_duplicates_over_real_sockets(
    stream: tuple[FakeVllmPublisher, VllmAdapter, AsyncIterator[KVEvent]],
) -> None:
    engine, adapter, events = stream
    await engine.store([1], None, [1, 2, 3, 4])
    assert await take(events, 1) == [
        BlockStored("w", 0, 0, Tier.GPU, h([1, 2, 3, 4]), None, [1, 2, 3, 4])
    ]
    engine.gap(1)
    await engine.store([2], None, [5, 6, 7, 8])  # lost live: comes back from the replay socket
    await engine.store([2], None, [5, 6, 7, 8])  # the same block stored again (a duplicate)
    got = await take(events, 2)
    assert [e.block_hashes for e in got] == [h([5, 6, 7, 8])] * 2  # type: ignore[attr-defined]
    assert adapter.metrics.value("sequence_gaps", worker="w") == 1
    await engine.remove([2])  # one copy of two: nothing leaves
    await engine.remove([2])
    assert await take(events, 1) == [BlockRemoved("w", 0, 0, Tier.GPU, h([5, 6, 7, 8]))]
    # The engine restarts its counter on the same sockets: a new epoch, rebuilt from replay.
    engine.reset_counter()
    await engine.store([3], None, [9, 9, 9, 9])
    got = await take(events, 2)
    assert isinstance(got[0], AllBlocksCleared) and got[0].tier is Tier.GPU
    assert got[1] == BlockStored("w", 0, 0, Tier.GPU, h([9, 9, 9, 9]), None, [9, 9, 9, 9])
    assert adapter.metrics.value("resyncs", worker="w", reason="sequence_reset") == 1
