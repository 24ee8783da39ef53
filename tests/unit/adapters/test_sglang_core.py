"""SGLang wire decoding, sequence tracking and batch normalization (no sockets)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from structlog.testing import capture_logs

from adapters.normalize import WorkerNormalizer
from adapters.normalize_metrics import AdapterMetrics
from adapters.sglang.core import BlockSizeMismatchError, RankNormalizer, RankSequencer, SeqAction
from adapters.sglang.wire import (
    BadEvent,
    FrameError,
    SgBlockStored,
    decode_batch,
    decode_batch_lenient,
    parse_seq,
    tier_of,
)
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kvcore.hashing import BlockHasher
from kvcore.namespace import Namespace

BS = 4


def stored(hashes: list[int], parent: int | None, tokens: list[Any], **extra: Any) -> dict:
    """A BlockStored exactly as SGLang puts it on the wire (a tagged map)."""
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
    }
    event.update(extra)
    return event


def payload(*events: dict, rank: int = 0) -> bytes:
    return msgspec.msgpack.encode([1700000000.5, list(events), rank])


def make_core() -> tuple[RankNormalizer, AdapterMetrics]:
    metrics = AdapterMetrics("sglang")
    norm = WorkerNormalizer("w", "m", BlockHasher(BS), metrics)
    return RankNormalizer(norm, metrics), metrics


def test_typed_decode_of_a_batch() -> None:
    """The fast path decodes SGLang's [ts, events, rank] with all three event types."""
    batch = decode_batch(
        payload(
            stored([1], None, [1, 2, 3, 4], cache_salt="s"),
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU_PINNED"},
            {"type": "AllBlocksCleared"},
            rank=3,
        )
    )
    assert batch.attn_dp_rank == 3
    first = batch.events[0]
    assert isinstance(first, SgBlockStored) and first.cache_salt == "s"
    assert [type(e).__name__ for e in batch.events] == [
        "SgBlockStored",
        "SgBlockRemoved",
        "SgAllBlocksCleared",
    ]


def test_lenient_decode_keeps_good_events_around_a_bad_one() -> None:
    """An unknown event type is returned as BadEvent; the others still decode."""
    raw = payload(
        stored([1], None, [1, 2, 3, 4]), {"type": "Mystery", "x": 1}, {"type": "AllBlocksCleared"}
    )
    with pytest.raises(msgspec.ValidationError):
        decode_batch(raw)
    _, events, _ = decode_batch_lenient(raw)
    assert isinstance(events[1], BadEvent) and "Mystery" in events[1].reason
    assert isinstance(events[0], SgBlockStored)


def test_bigram_pages_use_the_first_token_of_each_pair() -> None:
    """EAGLE bigram pages carry [t_i, t_i+1] pairs; the page's tokens are the first ones."""
    _, events, _ = decode_batch_lenient(
        payload(stored([1], None, [[1, 2], [2, 3], [3, 4], [4, 5]]))
    )
    assert isinstance(events[0], SgBlockStored)
    assert events[0].token_ids == [1, 2, 3, 4]


@pytest.mark.parametrize("raw", [b"", b"\xc1", msgspec.msgpack.encode({"a": 1})])
def test_lenient_decode_rejects_non_batches(raw: bytes) -> None:
    """A payload that is not a batch at all raises FrameError with the raw head."""
    with pytest.raises(FrameError, match="not an SGLang event batch"):
        decode_batch_lenient(raw)


def test_seq_frame_and_media() -> None:
    """Seq frames are 8 bytes big-endian; media map to tiers, unknown ones to None."""
    assert parse_seq((258).to_bytes(8, "big")) == 258
    with pytest.raises(FrameError, match="8"):
        parse_seq(b"\x01")
    assert [tier_of(m) for m in (None, "GPU", "CPU_PINNED", "DISK", "EXTERNAL", "NVME")] == [
        Tier.GPU,
        Tier.GPU,
        Tier.HOST,
        Tier.DISK,
        Tier.REMOTE,
        None,
    ]


def test_sequencer_rules() -> None:
    """Apply in order, gap on a jump, skip replayed duplicates, restart on a live reset."""
    seq = RankSequencer()
    assert seq.on_live(5) is SeqAction.APPLY  # first message: whatever seq
    seq.applied(5)
    assert seq.on_live(6) is SeqAction.APPLY
    seq.applied(6)
    assert seq.on_live(9) is SeqAction.GAP
    assert seq.on_replay(7) is SeqAction.APPLY
    seq.applied(7)
    assert seq.on_replay(7) is SeqAction.SKIP
    assert seq.on_replay(9) is SeqAction.RANGE_GONE
    seq.applied(8)
    seq.applied(9)
    seq.applied(10)  # a replay reached past what live has shown
    assert seq.on_live(10) is SeqAction.SKIP  # live copy of a replayed batch
    assert seq.on_live(0) is SeqAction.RESTART  # live went backwards: new publisher


def test_normalizes_a_batch_with_canonical_hashes() -> None:
    """A stored/removed/cleared batch becomes canonical events with canonical hashes."""
    core, metrics = make_core()
    out: list[KVEvent] = []
    ok = core.apply(
        0,
        payload(
            stored([11, 12], None, list(range(8))),
            stored([13], 12, list(range(8, 12))),
            {"type": "BlockRemoved", "block_hashes": [13], "medium": "GPU"},
        ),
        out,
    )
    assert ok
    expect = BlockHasher(BS).hash_tokens(list(range(12)), Namespace("m").seed)
    assert out[0].block_hashes == expect[:2]
    assert out[1].block_hashes == expect[2:]
    assert out[2] == BlockRemoved("w", 0, 0, Tier.GPU, [expect[2]])
    assert metrics.value("engine_events", worker="w", type="BlockStored") == 2
    core.apply(1, payload({"type": "AllBlocksCleared"}), out)
    assert isinstance(out[-1], AllBlocksCleared)


def test_malformed_event_is_counted_logged_and_skipped() -> None:
    """A bad event is counted once, logged with the raw head; the rest of the batch applies."""
    core, metrics = make_core()
    out: list[KVEvent] = []
    raw = payload(
        stored([1], None, [1, 2, 3, 4]),
        stored([2], 1, [5, 6, 7, 8, 9, 10]),  # too many tokens for one block
        {"type": "BlockStored", "block_hashes": "nope"},
        stored([3], None, [9, 9, 9, 9], medium="HBM3"),  # unknown medium
        stored([4], None, [4, 4, 4, 4]),
    )
    with capture_logs() as logs:
        ok = core.apply(0, raw, out)
    assert not ok
    assert [e.block_hashes for e in out if isinstance(e, BlockStored)] == [
        BlockHasher(BS).hash_tokens([1, 2, 3, 4], Namespace("m").seed),
        BlockHasher(BS).hash_tokens([4, 4, 4, 4], Namespace("m").seed),
    ]
    failures = [entry for entry in logs if entry["event"] == "kv_event_decode_failed"]
    assert len(failures) == 1  # once per seq, however many bad events it holds
    assert failures[0]["raw_head"] and failures[0]["worker_id"] == "w"
    assert metrics.value("decode_errors", worker="w", kind="event") == 1
    core.apply(0, raw, [])  # the same seq replayed during a resync: not counted again
    assert metrics.value("decode_errors", worker="w", kind="event") == 1


def test_undecodable_payload_is_a_frame_error() -> None:
    """Garbage instead of a batch is counted as a frame decode error."""
    core, metrics = make_core()
    assert not core.apply(4, b"\x93garbage", [])
    assert metrics.value("decode_errors", worker="w", kind="frame") == 1


def test_block_size_mismatch_fails_fast() -> None:
    """Blocks of another size than the adapter's cannot be hashed: a clear error, no resync."""
    core, _ = make_core()
    bad = stored([1], None, list(range(8)))
    bad["block_size"] = 8
    with pytest.raises(BlockSizeMismatchError, match="--block-size 8"):
        core.apply(0, payload(bad), [])
