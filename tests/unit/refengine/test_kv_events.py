"""KV-event schema and recorder: SGLang's wire shape and coalescing rules."""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from refengine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    EventRecorder,
    KVEventBatch,
    KVEventsConfig,
)


def _wire(events: list) -> list:
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(1.5, events, 0))
    return msgpack.unpackb(payload, raw=False)


def test_batch_is_array_and_events_are_tagged_maps() -> None:
    """A batch is [ts, events, dp_rank]; events are maps tagged by 'type', None omitted."""
    rec = EventRecorder(True)
    rec.stored([1, 2], None, list(range(32)), 16, cache_salt=None)
    rec.removed([1])
    rec.cleared()
    ts, events, rank = _wire(rec.take())
    assert (ts, rank) == (1.5, 0)
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
    }
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
    assert events[2] == {"type": "AllBlocksCleared"}


def test_salt_is_sent_when_set() -> None:
    """BlockStored carries cache_salt for salted requests."""
    rec = EventRecorder(True)
    rec.stored([7], 3, [0] * 16, 16, cache_salt="t")
    (event,) = _wire(rec.take())[1]
    assert event["cache_salt"] == "t"
    assert event["parent_block_hash"] == 3


def test_chained_stores_coalesce_and_others_do_not() -> None:
    """A store whose parent is the previous store's last hash is appended to it."""
    rec = EventRecorder(True)
    rec.stored([1], None, [0] * 16, 16, cache_salt=None)
    rec.stored([2], 1, [1] * 16, 16, cache_salt=None)
    rec.stored([9], 5, [2] * 16, 16, cache_salt=None)  # another branch
    rec.removed([1])
    rec.removed([2])
    events = rec.take()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockStored", "BlockRemoved"]
    assert events[0].block_hashes == [1, 2] and len(events[0].token_ids) == 32
    assert events[0].block_size == 16
    assert isinstance(events[2], BlockRemoved) and events[2].block_hashes == [1, 2]
    assert rec.take() == []


def test_disabled_recorder_records_nothing() -> None:
    """With publishing off the recorder stays empty."""
    rec = EventRecorder(False)
    rec.stored([1], None, [0] * 16, 16, cache_salt=None)
    rec.cleared()
    assert rec.take() == []
    assert AllBlocksCleared() == AllBlocksCleared()


def test_config_parses_sglang_json_and_rejects_junk() -> None:
    """--kv-events-config takes SGLang's keys; unknown keys and bad JSON are errors."""
    cfg = KVEventsConfig.from_cli(
        '{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558",'
        '"topic":"kv-events"}'
    )
    assert cfg.enabled and cfg.topic == "kv-events" and cfg.buffer_steps == 10_000
    assert not KVEventsConfig.from_cli(None).enabled
    for bad in ('{"publisher":"kafka"}', '{"nope":1}', "{", "[]"):
        with pytest.raises(ValueError):
            KVEventsConfig.from_cli(bad)


@pytest.mark.sglang
def test_sglang_decodes_our_batches() -> None:
    """SGLang's own msgspec types decode what we encode, field for field."""
    kv = pytest.importorskip("sglang.srt.disaggregation.kv_events")
    rec = EventRecorder(True)
    rec.stored([1, 2], None, list(range(32)), 16, cache_salt="s")
    rec.removed([2])
    rec.cleared()
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(2.0, rec.take(), 0))
    batch = msgspec.msgpack.Decoder(kv.KVEventBatch).decode(payload)
    stored, removed, cleared = batch.events
    assert isinstance(stored, kv.BlockStored) and stored.cache_salt == "s"
    assert stored.block_hashes == [1, 2] and stored.medium == "GPU"
    assert isinstance(removed, kv.BlockRemoved) and removed.block_hashes == [2]
    assert isinstance(cleared, kv.AllBlocksCleared)
