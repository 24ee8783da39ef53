"""SGLang's own ``RadixCache`` drives a sidecar and a gateway (the `sglang` extra).

The cache is SGLang's real class (``RadixCache.create_simulated``: the tree, its page
alignment, LRU eviction and reset, with ``enable_kv_cache_events=True``), and its events
leave through SGLang's real ``ZmqEventPublisher`` exactly as the scheduler sends them
(``take_events()`` → ``KVEventBatch`` → ``publish``). A sidecar (a real process, pointed at
the publisher with ``--kv-events-endpoint``) relays them and a real gateway indexes them;
after every step (insertions sharing prefixes, evictions, a reset, insertions again) the
gateway's ``cached_blocks`` for the worker must equal the cache's live pages. The reference
engine, publishing nothing, answers the sidecar's HTTP side only.
"""

from __future__ import annotations

import random
import time
import warnings
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvsidecar.local_stack import EngineSpec, ExternalPublisher, GatewaySpec, LocalStack, StackSpec
from tests.support.polling import eventually
from tests.support.sglang_shim import stub_vision_modules

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
PAGE = 16


class _Allocator:
    """What the simulated cache needs of the KV pool: a device and a way to free pages."""

    device = "cpu"

    def free_segment(self, value: Any, start_pos: int = 0) -> None:
        """Evicted pages go back to nobody: the test has no KV pool."""


@pytest.fixture
def sglang_cache() -> Iterator[tuple[Any, Any, type, type, type]]:
    """SGLang's radix cache (events on) and its ZMQ publisher on ephemeral ports."""
    stub_vision_modules()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGLang's CPU-only import warnings (AWQ, GGUF)
        from sglang.srt.disaggregation import kv_events
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    cache = RadixCache.create_simulated(
        page_size=PAGE, enable_kv_cache_events=True, mock_allocator=_Allocator()
    )
    publisher = kv_events.ZmqEventPublisher(
        0, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", bind=True,
        buffer_steps=1000,
    )
    try:
        yield cache, publisher, RadixKey, InsertParams, EvictParams
    finally:
        publisher.shutdown()


def live_pages(cache: Any) -> int:
    """Pages the cache holds (every node's key is page-aligned)."""
    total: int = cache.total_size()
    assert total % PAGE == 0
    return total // PAGE


async def test_gateway_counts_equal_sglangs_radix_cache_through_inserts_evictions_resets(
    tmp_path: Path, session: aiohttp.ClientSession, sglang_cache: tuple[Any, ...]
) -> None:
    cache, publisher, radix_key, insert_params, evict_params = sglang_cache
    from sglang.srt.disaggregation.kv_events import KVEventBatch

    def publish() -> None:
        """The scheduler's publish step (``publish_kv_events``)."""
        events = cache.take_events()
        if events:
            publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def insert(tokens: list[int]) -> None:
        cache.insert(insert_params(key=radix_key(array("q", tokens))))

    outside = ExternalPublisher(events=publisher._local_pub_endpoint,
                        replay=publisher._local_replay_endpoint)
    spec = StackSpec(
        engines=(EngineSpec(worker_ids=("sg",), sidecar_args=("--block-size", str(PAGE)),
                            publisher=outside),),
        gateways=(GatewaySpec(args=("--served-model-name", "tiny"), wait_routable=False),))
    async with LocalStack(spec, tmp_path) as stack:
        async def indexed_equals_cache(step: str) -> None:
            want = live_pages(cache)

            async def matches() -> bool:
                async with session.get(f"{stack.url}/v1/workers") as resp:
                    workers = (await resp.json())["workers"]
                return len(workers) == 1 and workers[0]["cached_blocks"]["gpu"] == want

            await eventually(matches, f"the gateway to index {want} blocks after {step}", 30)

        publish()  # the reset the cache recorded when it was built
        rng = random.Random(17)
        system = [rng.randrange(1, 30000) for _ in range(3 * PAGE)]
        prompts = [system + [rng.randrange(1, 30000) for _ in range(rng.randrange(20, 90))]
                   for _ in range(8)]
        for prompt in prompts:
            insert(prompt)
        publish()
        assert live_pages(cache) > len(system) // PAGE
        await indexed_equals_cache("eight prompts sharing a system prompt")

        cache.evict(evict_params(num_tokens=5 * PAGE))  # LRU leaves, whole nodes
        publish()
        await indexed_equals_cache("an eviction")

        insert(prompts[0] + [7] * (2 * PAGE))  # an old prefix extended
        publish()
        await indexed_equals_cache("a prompt extending a cached one")

        cache.reset()
        publish()
        assert live_pages(cache) == 0
        await indexed_equals_cache("a reset")

        for prompt in prompts[:3]:
            insert(prompt)
        publish()
        await indexed_equals_cache("inserts after the reset")
