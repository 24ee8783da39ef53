"""The adapter contract: every adapter's normalized stream means the same thing.

One suite, parametrized over [fake, sglang, vllm, trtllm]. The engines are fakes at the engine
boundary speaking the real wire formats on real loopback sockets (ephemeral ports); the
adapters are the real ones. Their unstamped events go through the sidecar's real relay (the
one place that stamps them) and its wire codec; a consumer applies the stamped stream with
the checks every index does (seq contiguous from 1, one epoch) and compares what it ends up
with against what the engine really holds. A resync is the adapter's explicit
``AllBlocksCleared`` of the GPU tier.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from adapters.base import AdapterConfig, EngineAdapter, EngineKind, EventEndpoint
from adapters.normalize_metrics import AdapterMetrics
from adapters.sglang.adapter import SGLangAdapter
from adapters.trtllm.adapter import TrtllmAdapter
from adapters.vllm.adapter import VllmAdapter
from kvcore.events import (
    UNSTAMPED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Tier,
    WorkerSnapshot,
)
from kvcore.hashing import BlockHasher
from kvcore.namespace import Namespace
from kvcore.wire import decode
from sidecar.relay import EventRelay
from tests.unit.adapters.fake_adapter import FakeAdapter
from tests.unit.adapters.fake_engines import (
    FakeSGLangPublisher,
    FakeTrtllmServer,
    FakeVllmPublisher,
    Truth,
)

BS = 4
DEADLINE_S = 10.0


class Consumer:
    """Stamps adapter events through the relay and applies them the way an index does,
    checking its invariants."""

    def __init__(self) -> None:
        self.relay = EventRelay("w", block_size=BS, model_id="m", epoch=1)
        self.seq = 0
        self.resyncs = 0  # the adapter's AllBlocksCleared of the GPU tier
        self.blocks: dict[Tier, dict[int, int | None]] = {t: {} for t in Tier}
        self.events: list[KVEvent] = []

    def apply(self, unstamped: KVEvent) -> None:
        assert (unstamped.epoch, unstamped.seq) == (UNSTAMPED, UNSTAMPED), "the relay stamps"
        event = decode(self.relay.publish(unstamped))
        assert isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared)
        self.events.append(event)
        assert event.epoch == 1 and event.seq == self.seq + 1, f"seq {event.seq} after {self.seq}"
        self.seq = event.seq
        if isinstance(event, AllBlocksCleared) and event.tier is Tier.GPU:
            self.resyncs += 1
        held = self.blocks[event.tier]
        if isinstance(event, BlockStored):
            prev = event.parent_hash
            for h in event.block_hashes:
                held[h] = prev
                prev = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                held.pop(h, None)
        else:
            held.clear()

    def gpu(self) -> dict[int, int | None]:
        return dict(self.blocks[Tier.GPU])


def expected(truth: Truth, salt: str | None = None) -> dict[int, int | None]:
    """The canonical (hash → parent) map of what the engine holds."""
    hasher = BlockHasher(BS)
    seed = Namespace("m", None, salt).seed
    out: dict[int, int | None] = {}
    for h in truth.blocks:
        chain = hasher.hash_tokens(truth.token_path(h), seed)
        out[chain[-1]] = chain[-2] if len(chain) > 1 else None
    return out


@dataclass
class Harness:
    name: str
    adapter: Any  # an EngineAdapter
    engine: Any  # the fake engine (or the fake adapter itself)
    metrics: AdapterMetrics
    replays: bool
    consumer: Consumer
    stream: AsyncIterator[KVEvent]

    async def until(self, done: Callable[[Consumer], bool]) -> None:
        """Consume events until ``done`` holds (a deadline, never a sleep)."""
        async with asyncio.timeout(DEADLINE_S):
            while not done(self.consumer):
                self.consumer.apply(await anext(self.stream))


ZMQ_ENGINES = ("sglang", "vllm")  # replay fills their gaps


@pytest.fixture(params=["fake", "sglang", "vllm", "trtllm"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    name = request.param
    engine: Any
    adapter: Any
    if name == "fake":
        adapter = engine = FakeAdapter("w", "m", BS)
        metrics = adapter.metrics
    elif name == "sglang":
        engine = FakeSGLangPublisher(BS)
        metrics = AdapterMetrics("sglang")
        cfg = AdapterConfig(
            EngineKind.SGLANG,
            "http://127.0.0.1:9",
            "w",
            "m",
            block_size=BS,
            endpoints=(EventEndpoint(0, engine.endpoint, engine.replay_endpoint),),
            replay_timeout_s=2.0,
        )
        adapter = SGLangAdapter(cfg, metrics=metrics, idle_probe_s=0.05)
    elif name == "vllm":
        engine = FakeVllmPublisher(BS)
        metrics = AdapterMetrics("vllm")
        cfg = AdapterConfig(
            EngineKind.VLLM,
            "http://127.0.0.1:9",
            "w",
            "m",
            block_size=BS,
            endpoints=(EventEndpoint(0, engine.endpoint, engine.replay_endpoint),),
            replay_timeout_s=2.0,
        )
        adapter = VllmAdapter(cfg, metrics=metrics, idle_probe_s=0.05)
    else:
        engine = FakeTrtllmServer(BS)
        await engine.start()
        metrics = AdapterMetrics("trtllm")
        cfg = AdapterConfig(
            EngineKind.TRTLLM,
            engine.url,
            "w",
            "m",
            block_size=BS,
            poll_interval_s=0.01,
        )
        adapter = TrtllmAdapter(cfg, metrics=metrics)
    await adapter.start()
    assert isinstance(adapter, EngineAdapter)  # checks attributes: after start (info)
    try:
        if name in ZMQ_ENGINES:
            async with asyncio.timeout(DEADLINE_S):
                await adapter.subscribers[0].connected.wait()
        yield Harness(
            name, adapter, engine, metrics, name in ZMQ_ENGINES, Consumer(), aiter(adapter.events())
        )
    finally:
        await adapter.aclose()
        if engine is not adapter:
            await engine.aclose()


def h(tokens: list[int], salt: str | None = None) -> list[int]:
    return BlockHasher(BS).hash_tokens(tokens, Namespace("m", None, salt).seed)


async def test_same_native_history_gives_the_same_canonical_events(harness: Harness) -> None:
    """Stored chains, a child and a removal normalize to identical events on every engine."""
    eng = harness.engine
    await eng.store([11, 12], None, list(range(8)))
    await eng.store([13], 12, list(range(8, 12)))
    await eng.remove([13, 12])
    await harness.until(lambda c: c.seq >= 3)
    full = h(list(range(12)))
    assert harness.consumer.events == [
        BlockStored("w", 1, 1, Tier.GPU, full[:2], None, list(range(8))),
        BlockStored("w", 1, 2, Tier.GPU, full[2:], full[1], list(range(8, 12))),
        BlockRemoved("w", 1, 3, Tier.GPU, [full[2], full[1]]),
    ]
    assert harness.consumer.gpu() == expected(eng.truth)


async def test_salted_requests_live_in_their_own_namespace(harness: Harness) -> None:
    """A cache salt changes every canonical hash of the chain."""
    await harness.engine.store([21], None, [1, 2, 3, 4], salt="tenant-a")
    await harness.until(lambda c: c.seq >= 1)
    assert harness.consumer.gpu() == {h([1, 2, 3, 4], "tenant-a")[0]: None}


async def test_clear_empties_the_worker(harness: Harness) -> None:
    """A cache flush leaves the consumer with nothing for that worker."""
    eng = harness.engine
    await eng.store([1, 2], None, list(range(8)))
    await harness.until(lambda c: len(c.gpu()) == 2)
    await eng.clear()
    await harness.until(lambda c: not c.gpu())
    assert eng.truth.blocks == {}


async def test_gap_is_filled_or_resynced(harness: Harness) -> None:
    """Lost events come back by replay (SGLang) or end in a resync; never a wrong block."""
    eng = harness.engine
    await eng.store([1], None, [1, 2, 3, 4])
    await harness.until(lambda c: len(c.gpu()) == 1)
    eng.gap(1)
    await eng.store([2], None, [5, 6, 7, 8])  # lost live
    await eng.store([3], None, [9, 9, 9, 9])
    want = expected(eng.truth)
    third = h([9, 9, 9, 9])[0]
    await harness.until(lambda c: third in c.gpu())
    got = harness.consumer.gpu()
    assert got.items() <= want.items(), "only blocks the engine holds"
    if harness.replays:
        assert got == want and harness.consumer.resyncs == 0
        assert harness.metrics.value("sequence_gaps", worker="w") == 1
        assert harness.metrics.value("replays", worker="w", outcome="ok") >= 1
    elif harness.name == "trtllm":
        assert harness.consumer.resyncs == 1
        assert harness.metrics.value("resyncs", worker="w", reason="event_gap") == 1


async def test_engine_restart_signals_a_resync(harness: Harness) -> None:
    """A restarted engine's worker starts over: the adapter clears it, old blocks gone."""
    eng = harness.engine
    await eng.store([1, 2], None, list(range(8)))
    await harness.until(lambda c: len(c.gpu()) == 2)
    await eng.restart()
    await eng.store([5], None, [4, 4, 4, 4])
    await harness.until(lambda c: c.gpu() == {h([4, 4, 4, 4])[0]: None})
    assert harness.consumer.resyncs >= 1
    assert harness.consumer.gpu() == expected(eng.truth)
    kinds = [type(e) for e in harness.consumer.events]
    assert AllBlocksCleared in kinds[kinds.index(BlockStored) + 1 :], "cleared after the store"
    zmq_reasons = ("publisher_reconnected", "sequence_reset")
    reasons = {"sglang": zmq_reasons, "vllm": zmq_reasons, "trtllm": ("event_id_reset",)}
    if harness.name in reasons:
        assert (
            sum(
                harness.metrics.value("resyncs", worker="w", reason=r)
                for r in reasons[harness.name]
            )
            >= 1
        )


async def test_malformed_event_is_counted_and_loses_nothing_else(harness: Harness) -> None:
    """A corrupt event is a decode error and a resync; events after it still arrive."""
    eng = harness.engine
    await eng.store([1], None, [1, 2, 3, 4])
    await harness.until(lambda c: len(c.gpu()) == 1)
    await eng.garbage()
    await eng.store([2], None, [5, 6, 7, 8])
    second = h([5, 6, 7, 8])[0]
    await harness.until(lambda c: second in c.gpu() and c.resyncs >= 1)
    assert (
        harness.metrics.value("decode_errors", worker="w", kind="event")
        + harness.metrics.value("decode_errors", worker="w", kind="envelope")
        == 1
    )
    got = harness.consumer.gpu()
    assert got.items() <= expected(eng.truth).items()
    if harness.replays:  # the rebuild replays the whole buffer: nothing but the bad event lost
        await harness.until(lambda c: len(c.gpu()) == 2)


async def test_relay_snapshot_matches_the_consumed_stream(harness: Harness) -> None:
    """The relay's snapshot at (epoch, seq) equals the state a consumer reaches at that seq."""
    eng = harness.engine
    await eng.store([1, 2, 3], None, list(range(12)))
    await eng.remove([3])
    await eng.store([4], 2, [7, 7, 7, 7])
    await harness.until(lambda c: c.seq >= 3)
    plan = harness.consumer.relay.plan(None, None)
    snap = decode(plan.backlog[0])
    assert isinstance(snap, WorkerSnapshot)
    assert (snap.epoch, snap.seq) == (1, harness.consumer.seq)
    (gpu,) = [t for t in snap.tiers if t.tier is Tier.GPU]
    assert dict(zip(gpu.block_hashes, gpu.parent_hashes, strict=True)) == harness.consumer.gpu()
    assert harness.adapter.info.worker_ids == ("w",)
