"""Our SGLang subscriber against SGLang's own ZmqEventPublisher (the `sglang` extra).

The publisher is SGLang's real class, on loopback with ephemeral ports, publishing batches
built with SGLang's own event structs, so each fault can be placed exactly (SGLang's own
RadixCache drives the publisher in ``tests/engines/sidecar/test_sglang_radix_cache.py``).
Faults are injected at the engine boundary only: one live send is swallowed (a gap the
publisher's own replay buffer must fill), and the publisher is shut down and replaced by a
fresh one on the same ports (an engine restart).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

kv_events = pytest.importorskip("sglang.srt.disaggregation.kv_events")

from adapters.base import AdapterConfig, EngineKind, EventEndpoint  # noqa: E402
from adapters.normalize_metrics import AdapterMetrics  # noqa: E402
from adapters.sglang.adapter import SGLangAdapter  # noqa: E402
from kvcore.events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Tier,
)
from kvcore.hashing import BlockHasher  # noqa: E402
from kvcore.namespace import Namespace  # noqa: E402
from tests.support.net import ports_free  # noqa: E402
from tests.support.polling import eventually  # noqa: E402
from tests.support.publishers import DropOneSend  # noqa: E402

pytestmark = pytest.mark.sglang

PAGE = 16
DEADLINE_S = 15.0


def h(tokens: list[int], salt: str | None = None) -> list[int]:
    return BlockHasher(PAGE).hash_tokens(tokens, Namespace("m", None, salt).seed)


def stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: Any) -> Any:
    return kv_events.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=PAGE,
        lora_id=None,
        medium=kw.pop("medium", "GPU"),
        **kw,
    )


def batch(*events: Any) -> Any:
    return kv_events.KVEventBatch(ts=time.time(), events=list(events))


async def new_publisher(endpoint: str, replay: str) -> Any:
    """SGLang's publisher; on fixed ports once the previous one has let them go."""
    await eventually(lambda: ports_free(endpoint, replay), f"{endpoint} / {replay} to be free",
                     DEADLINE_S)
    return kv_events.ZmqEventPublisher(
        0, endpoint=endpoint, replay_endpoint=replay, bind=True, buffer_steps=1000
    )


@pytest.fixture
async def publisher() -> AsyncIterator[Any]:
    pub = await new_publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    holder = [pub]
    yield holder
    await asyncio.to_thread(holder[0].shutdown)


async def start_adapter(pub: Any) -> tuple[SGLangAdapter, AdapterMetrics]:
    metrics = AdapterMetrics("sglang")
    cfg = AdapterConfig(
        EngineKind.SGLANG,
        "http://127.0.0.1:9",
        "w",
        "m",
        block_size=PAGE,
        endpoints=(EventEndpoint(0, pub._local_pub_endpoint, pub._local_replay_endpoint),),
    )
    adapter = SGLangAdapter(cfg, metrics=metrics, idle_probe_s=0.1)
    await adapter.start()
    async with asyncio.timeout(DEADLINE_S):
        await adapter.subscribers[0].connected.wait()
    return adapter, metrics


async def collect(
    stream: AsyncIterator[KVEvent], out: list[KVEvent], done: Callable[[], bool]
) -> None:
    async with asyncio.timeout(DEADLINE_S):
        while not done():
            out.append(await anext(stream))


def held(events: list[KVEvent]) -> set[int]:
    """GPU blocks after applying ``events``."""
    blocks: set[int] = set()
    for e in events:
        if isinstance(e, BlockStored):
            blocks.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            blocks.difference_update(e.block_hashes)
        elif isinstance(e, AllBlocksCleared):
            blocks.clear()
    return blocks


async def test_real_publisher_events_normalize(publisher: list[Any]) -> None:
    """Coalesced chains, salts, host-tier stores and removals from SGLang's publisher."""
    pub = publisher[0]
    adapter, _ = await start_adapter(pub)
    try:
        stream = aiter(adapter.events())
        tokens = list(range(3 * PAGE))
        pub.publish(batch(stored([-5, 6, -7], None, tokens)))
        pub.publish(
            batch(
                stored([8], None, tokens[:PAGE], cache_salt="tenant-a"),
                stored([-5], None, tokens[:PAGE], medium="CPU_PINNED"),
            )
        )
        pub.publish(batch(kv_events.BlockRemoved(block_hashes=[-7], medium="GPU")))
        out: list[KVEvent] = []
        await collect(stream, out, lambda: len(out) >= 4)
        full = h(tokens)
        assert out[0] == BlockStored("w", 0, 0, Tier.GPU, full, None, tokens)
        assert out[1].block_hashes == h(tokens[:PAGE], "tenant-a")
        assert out[2] == BlockStored("w", 0, 0, Tier.HOST, full[:1], None, tokens[:PAGE])
        assert out[3] == BlockRemoved("w", 0, 0, Tier.GPU, [full[2]])
    finally:
        await adapter.aclose()


async def test_gap_filled_by_the_publishers_replay(publisher: list[Any]) -> None:
    """A batch lost on the live socket comes back from SGLang's replay ROUTER, in order."""
    pub = publisher[0]
    adapter, metrics = await start_adapter(pub)
    try:
        stream = aiter(adapter.events())
        out: list[KVEvent] = []
        pub.publish(batch(stored([1], None, [1] * PAGE)))
        await collect(stream, out, lambda: len(out) >= 1)
        pub._pub = DropOneSend(pub._pub, drop_seq=1)
        pub.publish(batch(stored([2], None, [2] * PAGE)))  # seq 1: never sent live
        pub.publish(batch(stored([3], None, [3] * PAGE)))  # seq 2: reveals the gap
        await collect(stream, out, lambda: len(out) >= 3)
        assert [e.block_hashes for e in out] == [h([1] * PAGE), h([2] * PAGE), h([3] * PAGE)]
        assert not any(isinstance(e, AllBlocksCleared) for e in out)  # filled, no resync
        assert metrics.value("sequence_gaps", worker="w") == 1
        assert metrics.value("replays", worker="w", outcome="ok") >= 1
        assert metrics.value("resyncs", worker="w", reason="replay_range_gone") == 0
    finally:
        await adapter.aclose()


async def test_late_subscriber_rebuilds_from_the_replay_buffer(publisher: list[Any]) -> None:
    """Batches published before the subscriber existed are replayed at start-up."""
    pub = publisher[0]
    pub.publish(batch(kv_events.AllBlocksCleared()))
    pub.publish(batch(stored([1, 2], None, list(range(2 * PAGE)))))
    adapter, _ = await start_adapter(pub)
    try:
        out: list[KVEvent] = []
        await collect(aiter(adapter.events()), out, lambda: len(held(out)) == 2)
        assert held(out) == set(h(list(range(2 * PAGE))))
    finally:
        await adapter.aclose()


async def test_publisher_restart_resyncs(publisher: list[Any]) -> None:
    """A new publisher on the same ports (seq from 0): a resync, old blocks gone, rebuilt."""
    pub = publisher[0]
    endpoint, replay = pub._local_pub_endpoint, pub._local_replay_endpoint
    adapter, metrics = await start_adapter(pub)
    try:
        stream = aiter(adapter.events())
        out: list[KVEvent] = []
        pub.publish(batch(stored([1, 2], None, list(range(2 * PAGE)))))
        await collect(stream, out, lambda: len(held(out)) == 2)
        await asyncio.to_thread(pub.shutdown)
        pub = publisher[0] = await new_publisher(endpoint, replay)
        pub.publish(batch(kv_events.AllBlocksCleared()))  # the radix cache reset at start-up
        pub.publish(batch(stored([9], None, [9] * PAGE)))
        await collect(stream, out, lambda: held(out) == set(h([9] * PAGE)))
        assert any(isinstance(e, AllBlocksCleared) and e.tier is Tier.GPU for e in out[1:])
        assert (
            metrics.value("resyncs", worker="w", reason="publisher_reconnected")
            + (metrics.value("resyncs", worker="w", reason="sequence_reset"))
            >= 1
        )
    finally:
        await adapter.aclose()
