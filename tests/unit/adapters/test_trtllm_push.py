"""TensorRT-LLM 1.4's pushed KV events (``adapters.trtllm.push``) from fixture frames written
as its ``ZmqEventPublisher`` writes them (``fixtures/trtllm_push``): decoding, both hash forms,
multimodal blocks skipped, and per-rank subscribers over real loopback sockets (a gap filled
by replay, a restarted counter resynced, one worker per rank)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from adapters.base import AdapterConfig, EngineKind, EventEndpoint
from adapters.normalize import WorkerNormalizer
from adapters.normalize_metrics import AdapterMetrics
from adapters.trtllm.adapter import TrtllmAdapter
from adapters.trtllm.push import TrtBlockStored, TrtPushRankNormalizer, decode_push_batch
from adapters.trtllm.wire import engine_key
from adapters.vllm.wire import VlAllBlocksCleared, VlBlockRemoved
from adapters.zmq_events.endpoints import rank_endpoints
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kvcore.hashing import BlockHasher
from kvcore.namespace import Namespace
from tests.unit.adapters.fake_engines import FakeTrtllmPublisher
from tests.unit.adapters.fixtures.trtllm_push import make_frames

FRAMES = json.loads(Path(make_frames.OUT).read_text())
BS = FRAMES["block_size"]
TOPIC = FRAMES["topic"]
RANK0 = [bytes.fromhex(p) for p in FRAMES["ranks"]["0"]]
RANK1 = [bytes.fromhex(p) for p in FRAMES["ranks"]["1"]]
MASK = (1 << 64) - 1
DEADLINE_S = 10.0


def h(tokens: list[int], lora: str | None = None) -> list[int]:
    return BlockHasher(BS).hash_tokens(tokens, Namespace("m", lora, None).seed)


def core(worker: str = "w") -> TrtPushRankNormalizer:
    metrics = AdapterMetrics("trtllm")
    norm = WorkerNormalizer(worker, "m", BlockHasher(BS), metrics)
    return TrtPushRankNormalizer(norm, metrics, {3: "ad"})


def apply(c: TrtPushRankNormalizer, seq: int, payload: bytes) -> list[KVEvent]:
    out: list[KVEvent] = []
    assert c.apply(seq, payload, out)
    return out


def test_fixture_file_is_what_the_generator_writes() -> None:
    """``frames.json`` is reproducible from its generator (and so from the cited source)."""
    assert Path(make_frames.OUT).read_text() == make_frames.render()


def test_fixture_frames_decode_on_the_typed_path() -> None:
    """Every batch decodes typed: ``[ts, events, rank]``, events tagged by class name, V2
    hashes as signed int64 (both signs occur), V1 keys past 2**63, digest token ids."""
    decoded = [decode_push_batch(p) for p in RANK0 + RANK1]
    assert {rank for _, _, rank in decoded} == {0, 1}
    events = [e for _, evs, _ in decoded for e in evs]
    assert [isinstance(e, TrtBlockStored) for e in events[:4]] == [True] * 3 + [False]
    assert isinstance(events[3], VlBlockRemoved)
    assert isinstance(events[5], VlAllBlocksCleared)
    v2 = [x for e in events[:3] if isinstance(e, TrtBlockStored) for x in e.block_hashes]
    assert min(v2) < 0 < max(v2)
    assert max(events[6].block_hashes) > 2**63  # type: ignore[union-attr]  # rank 1: V1
    assert any(isinstance(t, str) for t in events[4].token_ids)  # type: ignore[union-attr]
    assert events[2].mm_keys[1][0]["type"] == "mm_key"  # type: ignore[union-attr,index]


def test_rank0_v2_stream_normalizes_to_canonical_events() -> None:
    """Stored chains (re-hashed from tokens), the parent across batches, a multimodal block
    and a digest-token block skipped, a removal and a clear."""
    c = core()
    got = [apply(c, seq, p) for seq, p in enumerate(RANK0)]
    first = h([1, 2, 3, 4, 5, 6, 7, 8])
    child = h([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])[2]
    assert got[0] == [BlockStored("w", 0, 0, Tier.GPU, first, None, [1, 2, 3, 4, 5, 6, 7, 8])]
    assert got[1] == [BlockStored("w", 0, 0, Tier.GPU, [child], first[1], [9, 10, 11, 12])]
    # The multimodal second block is dropped; the first, plain, is kept.
    assert got[2] == [BlockStored("w", 0, 0, Tier.GPU, h([20, 21, 22, 23]), None,
                                  [20, 21, 22, 23])]
    assert got[3] == [BlockRemoved("w", 0, 0, Tier.GPU, [child])]
    assert got[4] == []  # its only block has a digest token id
    assert len(got[5]) == 1 and isinstance(got[5][0], AllBlocksCleared)
    metrics = c.metrics
    assert metrics.value("blocks", worker="w", outcome="skipped") == 2
    assert metrics.value("engine_events", worker="w", type="BlockStored") == 4
    assert metrics.value("decode_errors", worker="w", kind="event") == 0


def test_v2_signed_hash_keys_as_the_http_answers_v2_sha256_64_form() -> None:
    """A signed V2 wire hash is keyed by its low 64 bits: the key the HTTP poll's
    ``v2_sha256_64`` form (the same 8 bytes, unsigned) gives the same block."""
    c = core()
    apply(c, 0, RANK0[0])
    (event,) = decode_push_batch(RANK0[0])[1]
    signed = event.block_hashes  # type: ignore[union-attr]
    assert any(x < 0 for x in signed)
    for x in signed:
        assert c.normalizer.holds(engine_key(x & MASK), Tier.GPU)


def test_rank1_v1_block_keys_with_a_lora_id() -> None:
    """u64 V1 keys decode and key blocks alike; ``lora_id`` names the adapter namespace."""
    c = core("w/dp1")
    stored = apply(c, 0, RANK1[0])
    blocks = h([40, 41, 42, 43, 44, 45, 46, 47], lora="ad")
    assert stored == [BlockStored("w/dp1", 0, 0, Tier.GPU, blocks, None,
                                  [40, 41, 42, 43, 44, 45, 46, 47])]
    assert apply(c, 1, RANK1[1]) == [BlockRemoved("w/dp1", 0, 0, Tier.GPU, [blocks[1]])]


def test_rank_endpoints_follow_the_publishers_port_offsets() -> None:
    """Rank r binds the base port plus r (ipc: suffix ``_dp<r>``), as
    ``ZmqEventPublisher.offset_endpoint_port`` does."""
    assert rank_endpoints("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5600", 2, "kv") == (
        EventEndpoint(0, "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5600", "kv"),
        EventEndpoint(1, "tcp://10.0.0.1:5558", "tcp://10.0.0.1:5601", "kv"),
    )
    assert rank_endpoints("ipc:///tmp/kv", None, 2)[1].endpoint == "ipc:///tmp/kv_dp1"
    with pytest.raises(ValueError, match="past port"):
        rank_endpoints("tcp://h:65535", None, 2)


# --- the adapter over real sockets --------------------------------------------------------------


@pytest.fixture
async def ranks() -> AsyncIterator[tuple[list[FakeTrtllmPublisher], TrtllmAdapter]]:
    engines = [FakeTrtllmPublisher(BS, topic=TOPIC.encode()) for _ in range(2)]
    cfg = AdapterConfig(
        EngineKind.TRTLLM, "http://127.0.0.1:9", "w", "m", block_size=BS,
        endpoints=tuple(EventEndpoint(r, e.endpoint, e.replay_endpoint, TOPIC)
                        for r, e in enumerate(engines)),
        lora_adapters=(),
    )
    adapter = TrtllmAdapter(cfg, metrics=AdapterMetrics("trtllm"), idle_probe_s=0.05)
    await adapter.start()
    try:
        async with asyncio.timeout(DEADLINE_S):
            for sub in adapter.subscribers:
                await sub.connected.wait()
        yield engines, adapter
    finally:
        await adapter.aclose()
        for e in engines:
            await e.aclose()


async def take(events: AsyncIterator[KVEvent], n: int) -> list[KVEvent]:
    async with asyncio.timeout(DEADLINE_S):
        return [await anext(events) for _ in range(n)]


async def test_each_rank_is_a_worker_and_gaps_and_restarts_recover(
    ranks: tuple[list[FakeTrtllmPublisher], TrtllmAdapter],
) -> None:
    """One canonical worker per rank; a batch lost live comes back from the rank's replay
    socket; a publisher whose seq starts over is a new epoch, rebuilt from its replay."""
    (rank0, rank1), adapter = ranks
    assert adapter.info.worker_ids == ("w/dp0", "w/dp1")
    events = aiter(adapter.events())
    await rank1.publish_raw(RANK1[0])
    (got,) = await take(events, 1)
    assert isinstance(got, BlockStored) and got.worker_id == "w/dp1"
    await rank0.publish_raw(RANK0[0])
    (got,) = await take(events, 1)
    assert isinstance(got, BlockStored) and got.worker_id == "w/dp0"
    rank0.gap(1)
    await rank0.publish_raw(RANK0[1])  # lost live: replayed when seq 2 shows the gap
    await rank0.publish_raw(RANK0[3])
    filled = await take(events, 2)
    child = h([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])[2]
    assert filled == [
        BlockStored("w/dp0", 0, 0, Tier.GPU, [child], h([1, 2, 3, 4, 5, 6, 7, 8])[1],
                    [9, 10, 11, 12]),
        BlockRemoved("w/dp0", 0, 0, Tier.GPU, [child]),
    ]
    assert adapter.metrics.value("sequence_gaps", worker="w/dp0") == 1
    rank0.reset_counter()  # the engine restarted on the same ports: seq 0 again
    await rank0.publish_raw(RANK0[0])
    rebuilt = await take(events, 2)
    assert isinstance(rebuilt[0], AllBlocksCleared) and rebuilt[0].worker_id == "w/dp0"
    assert isinstance(rebuilt[1], BlockStored)
    assert rebuilt[1].block_hashes == h([1, 2, 3, 4, 5, 6, 7, 8])
    assert adapter.metrics.value("resyncs", worker="w/dp0", reason="sequence_reset") == 1
    assert adapter.metrics.value("resyncs", worker="w/dp1", reason="sequence_reset") == 0


async def test_zmq_and_http_endpoints_do_not_mix() -> None:
    """A ZMQ endpoint beside an HTTP one is refused at start, naming both."""
    cfg = AdapterConfig(
        EngineKind.TRTLLM, "http://127.0.0.1:9", "w", "m", block_size=BS,
        endpoints=(EventEndpoint(0, "tcp://127.0.0.1:5557"),
                   EventEndpoint(1, "http://127.0.0.1:9")),
    )
    with pytest.raises(Exception, match="not both"):
        await TrtllmAdapter(cfg).start()
