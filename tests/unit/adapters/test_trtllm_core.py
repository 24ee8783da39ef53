"""TensorRT-LLM KV-event JSON → canonical events: schema, restarts, gaps, tiers, windows."""

from __future__ import annotations

import orjson
import pytest
from structlog.testing import capture_logs

from adapters.normalize_metrics import AdapterMetrics
from adapters.trtllm.adapter import TrtllmNormalizer
from adapters.trtllm.wire import BadEnvelope, Envelope, PlainStored, Stored, decode_envelopes
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kvcore.hashing import BlockHasher
from kvcore.namespace import Namespace
from tests.unit.adapters.trtllm_fixtures import (
    block,
    created,
    envelope,
    removed,
    stored,
    updated,
)

BS = 4
BIG = 2**64 - 5  # TensorRT-LLM hashes are u64 (C++ size_t)


def canon(tokens: list[int], salt: str | None = None, lora: str | None = None) -> list[int]:
    return BlockHasher(BS).hash_tokens(tokens, Namespace("m", lora, salt).seed)


def make(dp_size: int = 1) -> tuple[TrtllmNormalizer, AdapterMetrics]:
    metrics = AdapterMetrics("trtllm")
    return TrtllmNormalizer("w", "m", BS, dp_size, metrics), metrics


def run(norm: TrtllmNormalizer, *envelopes: dict) -> list[KVEvent]:
    return norm.apply_payload(orjson.dumps(list(envelopes)))


def test_decodes_the_serializer_shapes_with_u64_hashes() -> None:
    """Every data type of KVCacheEventSerializer decodes, u64 hashes intact."""
    raw = orjson.dumps(
        [
            envelope(0, created()),
            envelope(1, stored(None, [block(BIG, [1, 2, 3, 4])])),
            envelope(2, updated(BIG, (0, 1), (35, 35)), rank=0),
            envelope(3, removed([BIG])),
        ]
    )
    envs = decode_envelopes(raw)
    assert all(isinstance(e, Envelope) for e in envs)
    assert envs[1].data.blocks[0].block_hash == BIG  # type: ignore[union-attr]


def test_stored_chain_removed_and_parent_links() -> None:
    """A stored chain, a child under its last block and a removal normalize canonically."""
    norm, metrics = make()
    out = run(
        norm,
        envelope(0, created()),
        envelope(1, stored(None, [block(BIG, [1, 2, 3, 4]), block(7, [5, 6, 7, 8])])),
        envelope(2, stored(7, [block(8, [9, 10, 11, 12])])),
        envelope(3, removed([8, 999])),
    )
    h = canon(list(range(1, 13)))
    assert out[0] == BlockStored("w", 0, 0, Tier.GPU, h[:2], None, list(range(1, 9)))
    assert out[1] == BlockStored("w", 0, 0, Tier.GPU, h[2:], h[1], [9, 10, 11, 12])
    assert out[2] == BlockRemoved("w", 0, 0, Tier.GPU, [h[2]])
    assert metrics.value("engine_events", worker="w", type="stored") == 2
    assert metrics.value("blocks", worker="w", outcome="unknown_removed") == 1


def test_cache_levels_split_chains_and_updates_move_tiers() -> None:
    """cache_level 1 is the host tier; an updated cache_level diff moves the block."""
    norm, _ = make()
    out = run(
        norm,
        envelope(0, stored(None, [block(1, [1, 2, 3, 4]), block(2, [5, 6, 7, 8], cache_level=1)])),
        envelope(1, updated(1, (0, 1), (35, 35))),
        envelope(2, updated(2, None, (35, 10))),  # priority only: nothing to publish
    )
    h = canon(list(range(1, 9)))
    assert [(e.tier, e.block_hashes) for e in out] == [
        (Tier.GPU, [h[0]]),
        (Tier.HOST, [h[1]]),
        (Tier.GPU, [h[0]]),
        (Tier.HOST, [h[0]]),
    ]
    assert isinstance(out[2], BlockRemoved) and isinstance(out[3], BlockStored)


def test_salt_and_lora_namespaces() -> None:
    """Per-block cache_salt and a data-level lora_name select the namespace."""
    norm, _ = make()
    lora_event = stored(None, [block(2, [1, 2, 3, 4])])
    lora_event["lora_name"] = "ad"
    out = run(
        norm,
        envelope(0, stored(None, [block(1, [1, 2, 3, 4], cache_salt="t")])),
        envelope(1, lora_event),
    )
    assert out[0].block_hashes == canon([1, 2, 3, 4], salt="t")
    assert out[1].block_hashes == canon([1, 2, 3, 4], lora="ad")


def test_multimodal_partial_and_extra_id_blocks_are_skipped() -> None:
    """Blocks the tokens alone cannot identify, partial blocks, and their children are skipped."""
    norm, metrics = make()
    mm = [{"type": "mm_key", "hash": "ab" * 32, "start_offset": 0}]
    out = run(
        norm,
        envelope(
            0,
            stored(
                None,
                [
                    block(1, [1, 2, 3, 4]),
                    block(2, [9, 9, 9, 9], mm_keys=mm),
                    block(3, [5, 6, 7, 8]),
                ],
            ),
        ),
        envelope(1, stored(1, [block(4, [5, 6]), block(5, [1, 1, 1, 1])])),
        envelope(2, stored(None, [block(6, [1, 2, 3, 4], extra_ids=[0, 0, 7, 0])])),
    )
    assert [e.block_hashes for e in out] == [canon([1, 2, 3, 4])]
    assert metrics.value("blocks", worker="w", outcome="skipped") == 2 + 2 + 1


def test_event_ids_going_back_resync() -> None:
    """An engine restart (ids from 0 again, a created event) clears the worker: a resync."""
    norm, metrics = make()
    run(norm, envelope(0, created()), envelope(1, stored(None, [block(1, [1, 2, 3, 4])])))
    out = run(norm, envelope(0, created()), envelope(1, stored(None, [block(1, [1, 2, 3, 4])])))
    assert out[0] == AllBlocksCleared("w", 0, 0, Tier.GPU)
    assert out[1] == BlockStored("w", 0, 0, Tier.GPU, canon([1, 2, 3, 4]), None, [1, 2, 3, 4])
    assert metrics.value("resyncs", worker="w", reason="event_id_reset") == 1


def test_created_after_events_is_a_restart_even_without_id_reset() -> None:
    """A created event after stores means a fresh cache even if ids did not go back."""
    norm, metrics = make()
    run(norm, envelope(5, stored(None, [block(1, [1, 2, 3, 4])])))
    out = run(norm, envelope(6, created()))
    assert out == [AllBlocksCleared("w", 0, 0, Tier.GPU)]
    assert metrics.value("resyncs", worker="w", reason="engine_recreated") == 1


def test_gap_resyncs_and_keeps_what_follows() -> None:
    """Lost events (ids jump) cannot be replayed: a resync, then the later events apply."""
    norm, metrics = make()
    run(norm, envelope(1, stored(None, [block(1, [1, 2, 3, 4])])))
    with capture_logs() as logs:
        out = run(norm, envelope(5, stored(None, [block(2, [5, 6, 7, 8])])))
    assert [type(e) for e in out] == [AllBlocksCleared, BlockStored]
    assert out[1].token_ids == [5, 6, 7, 8]
    assert metrics.value("sequence_gaps", worker="w") == 1
    assert any(entry["event"] == "kv_event_gap_detected" for entry in logs)


def test_malformed_envelope_counts_logs_and_resyncs_without_losing_others() -> None:
    """An undecodable envelope is a decode error + resync; its neighbours still apply."""
    norm, metrics = make()
    with capture_logs() as logs:
        out = run(
            norm,
            envelope(0, stored(None, [block(1, [1, 2, 3, 4])])),
            envelope(1, {"type": "teleported", "block_hash": 3}),
            envelope(2, stored(None, [block(2, [5, 6, 7, 8])])),
        )
    assert [type(e) for e in out] == [BlockStored, AllBlocksCleared, BlockStored]
    assert out[2].block_hashes == canon([5, 6, 7, 8])
    assert metrics.value("decode_errors", worker="w", kind="envelope") == 1
    assert metrics.value("resyncs", worker="w", reason="malformed_event") == 1
    (failure,) = [entry for entry in logs if entry["event"] == "kv_event_decode_failed"]
    assert bytes.fromhex(failure["raw_head"]).startswith(b'{"event_id":1')


def test_garbage_answer_resyncs_every_rank() -> None:
    """An answer that is not a JSON array loses events of unknown ranks: all ranks resync."""
    norm, metrics = make(dp_size=2)
    out = norm.apply_payload(b"<html>oops</html>")
    assert sorted(e.worker_id for e in out) == ["w/dp0", "w/dp1"]
    assert metrics.value("decode_errors", worker="w", kind="payload") == 1


def test_attention_dp_ranks_are_separate_workers() -> None:
    """attention_dp_rank picks the worker; each rank counts its own event ids."""
    norm, _ = make(dp_size=2)
    out = run(
        norm,
        envelope(0, stored(None, [block(1, [1, 2, 3, 4])]), rank=0),
        envelope(0, stored(None, [block(1, [1, 2, 3, 4])]), rank=1),
        envelope(1, removed([1]), rank=1),
    )
    assert [(e.worker_id, type(e).__name__) for e in out] == [
        ("w/dp0", "BlockStored"),
        ("w/dp1", "BlockStored"),
        ("w/dp1", "BlockRemoved"),
    ]
    bad = run(norm, envelope(2, removed([1]), rank=5))
    assert isinstance(bad[0], AllBlocksCleared) and bad[0].worker_id == "w/dp0"


def test_only_the_largest_attention_window_is_kept() -> None:
    """With several window sizes (VSWA) the smaller windows' events are filtered out."""
    norm, metrics = make()
    out = run(
        norm,
        envelope(0, created(), window_size=128),
        envelope(1, created(), window_size=4096),
        envelope(2, stored(None, [block(1, [1, 2, 3, 4])]), window_size=128),
        envelope(3, stored(None, [block(2, [1, 2, 3, 4])]), window_size=4096),
    )
    assert len(out) == 1
    assert metrics.value("blocks", worker="w", outcome="filtered") == 1


@pytest.mark.parametrize("objects", [[{"event_id": 0, "data": {"type": "removed"}}], [42]])
def test_llm_api_objects_with_bad_shapes_are_bad_envelopes(objects: list) -> None:
    """The LLM API's dicts go through the same checks as the HTTP JSON."""
    norm, _ = make()
    assert isinstance(norm.apply_objects(objects)[0], AllBlocksCleared)
    from adapters.trtllm.wire import envelopes_from_objects

    assert isinstance(envelopes_from_objects(objects)[0], BadEnvelope)


def test_plain_answers_decode_typed_and_extra_ids_fall_back_to_the_general_types() -> None:
    """Zero extra ids decode as PlainStored; one non-zero id re-decodes the answer generally."""
    plain = [envelope(0, stored(None, [block(1, [1, 2, 3, 4])]))]
    first = decode_envelopes(orjson.dumps(plain))[0]
    assert isinstance(first, Envelope) and type(first.data) is PlainStored
    mixed = [*plain, envelope(1, stored(None, [block(2, [5, 6, 7, 8], extra_ids=[0, 3, 0, 0])]))]
    envs = decode_envelopes(orjson.dumps(mixed))
    assert [type(e.data) for e in envs if isinstance(e, Envelope)] == [Stored, Stored]
    norm, metrics = make()
    out = run(norm, *mixed, envelope(2, stored(1, [block(3, [9, 9, 9, 9])])))
    assert [e.block_hashes for e in out] == [canon([1, 2, 3, 4]), canon([1, 2, 3, 4] + [9] * 4)[1:]]
    assert metrics.value("blocks", worker="w", outcome="skipped") == 1
