"""TensorRT-LLM KV-event JSON → canonical events: schema, restarts, gaps, tiers, windows."""

from __future__ import annotations

import orjson
import pytest
from structlog.testing import capture_logs

from adapters.normalize_metrics import AdapterMetrics
from adapters.trtllm.adapter import TrtllmNormalizer
from adapters.trtllm.wire import (
    BadEnvelope,
    Envelope,
    PlainStored,
    Stored,
    decode_envelopes,
    engine_key,
)
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kvcore.hashing import BlockHasher
from kvcore.namespace import Namespace
from tests.unit.adapters.trtllm_fixtures import (
    block,
    created,
    envelope,
    removed,
    sha256_64,
    stored,
    updated,
    v2_block,
    v2_chain,
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


# --- the V2 KV cache manager's events (hash_algo, hex hashes, layer groups) -----------------

V2 = "v2_sha256"
SWA, FULL = 0, 1  # layer groups: a 128-token sliding window, and full attention


def v2_run(norm: TrtllmNormalizer, *events: tuple[int, dict, int], algo: str = V2) -> list[KVEvent]:
    """(event_id, data, layer_group_id) triples as the V2 manager serializes them."""
    windows = {SWA: 128, FULL: 4096}
    return run(norm, *(
        envelope(eid, data, windows[group], hash_algo=algo, layer_group_id=group)
        for eid, data, group in events
    ))


def v2_opening() -> list[tuple[int, dict, int]]:
    return [(0, created(), SWA), (1, created(), FULL)]


def test_v2_hex_hashes_store_and_remove_under_canonical_hashes() -> None:
    """v2_sha256 chains normalize to the same canonical hashes as V1 integers would."""
    norm, metrics = make()
    tokens = list(range(1, 13))
    k = [key.hex() for key in v2_chain(tokens, BS)]
    out = v2_run(
        norm,
        *v2_opening(),
        (2, stored(None, [v2_block(k[0], tokens[:4]), v2_block(k[1], tokens[4:8])]), FULL),
        (3, stored(None, [v2_block(k[0], tokens[:4]), v2_block(k[1], tokens[4:8])]), SWA),
        (4, stored(k[1], [v2_block(k[2], tokens[8:])]), FULL),
        (5, removed([k[0]]), SWA),  # the window slid past it: the full-attention KV stays
        (6, removed([k[2]]), FULL),
    )
    h = canon(tokens)
    assert out == [
        BlockStored("w", 0, 0, Tier.GPU, h[:2], None, tokens[:8]),
        BlockStored("w", 0, 0, Tier.GPU, h[2:], h[1], tokens[8:]),
        BlockRemoved("w", 0, 0, Tier.GPU, [h[2]]),
    ]
    assert metrics.value("blocks", worker="w", outcome="filtered") == 3
    assert metrics.value("decode_errors", worker="w", kind="envelope") == 0


def test_v2_sha256_64_hashes_are_u64_integers() -> None:
    """v2_sha256_64 writes the key's first 8 bytes big-endian: integers, like V1."""
    norm, _ = make()
    tokens = list(range(1, 9))
    k = [sha256_64(key) for key in v2_chain(tokens, BS)]
    assert all(0 <= x < 2**64 for x in k)
    out = v2_run(
        norm,
        (0, created(), FULL),
        (1, stored(None, [v2_block(k[0], tokens[:4])]), FULL),
        (2, stored(k[0], [v2_block(k[1], tokens[4:])]), FULL),
        (3, updated(k[1], (0, 1), None), FULL),
        (4, removed([k[0]]), FULL),
        algo="v2_sha256_64",
    )
    h = canon(tokens)
    assert [(type(e).__name__, e.tier, e.block_hashes) for e in out] == [
        ("BlockStored", Tier.GPU, [h[0]]),
        ("BlockStored", Tier.GPU, [h[1]]),
        ("BlockRemoved", Tier.GPU, [h[1]]),
        ("BlockStored", Tier.HOST, [h[1]]),
        ("BlockRemoved", Tier.GPU, [h[0]]),
    ]


def test_v2_restart_clears_and_rebuilds() -> None:
    """A restarted V2 engine (ids from 0, one created per group) clears the worker."""
    norm, metrics = make()
    tokens = [1, 2, 3, 4]
    k = v2_chain(tokens, BS)[0].hex()
    v2_run(norm, *v2_opening(), (2, stored(None, [v2_block(k, tokens)]), FULL))
    out = v2_run(norm, *v2_opening(), (2, stored(None, [v2_block(k, tokens)]), FULL))
    assert out == [
        AllBlocksCleared("w", 0, 0, Tier.GPU),
        BlockStored("w", 0, 0, Tier.GPU, canon(tokens), None, tokens),
    ]
    assert metrics.value("resyncs", worker="w", reason="event_id_reset") == 1


@pytest.mark.parametrize(
    ("algo", "data", "why"),
    [
        (V2, stored(None, [v2_block("ABCD", [1, 2, 3, 4])]), "matching regex"),
        (V2, stored(None, [v2_block("abc", [1, 2, 3, 4])]), "matching regex"),
        (V2, stored(None, [v2_block("", [1, 2, 3, 4])]), "matching regex"),
        (V2, stored(None, [v2_block("zz" * 32, [1, 2, 3, 4])]), "matching regex"),
        (V2, stored(None, [v2_block("ab" * 65, [1, 2, 3, 4])]), "matching regex"),
        (V2, stored("0x12", [v2_block("abcd", [1, 2, 3, 4])]), "matching regex"),
        (V2, removed(["ab", "nothex"]), "matching regex"),
        (V2, stored(None, [v2_block(43981, [1, 2, 3, 4])]), "writes str block hashes"),
        (V2, updated(43981, (0, 1), None), "writes str block hashes"),
        ("v1_block_key", removed(["abcd"]), "writes int block hashes"),
        ("v2_sha256_64", stored("abcd", [v2_block(7, [1, 2, 3, 4])]), "writes int"),
        (V2, stored(None, [v2_block("abcd", [1.5, 2, 3, 4])]), "Expected `int | str`"),
    ],
)
def test_malformed_v2_hashes_are_decode_errors(algo: str, data: dict, why: str) -> None:
    """A hash of the wrong form is a counted decode error and a resync, never a crash or a
    silently dropped block; the envelopes around it still apply."""
    norm, metrics = make()
    good = [5, 6, 7, 8]
    k = v2_chain(good, BS)[0].hex()
    with capture_logs() as logs:
        out = run(
            norm,
            envelope(0, stored(None, [v2_block(k, good)]), hash_algo=V2, layer_group_id=0),
            envelope(1, data, hash_algo=algo, layer_group_id=0),
            envelope(2, stored(None, [v2_block(k, good)]), hash_algo=V2, layer_group_id=0),
        )
    assert [type(e) for e in out] == [BlockStored, AllBlocksCleared, BlockStored]
    assert out[2].block_hashes == canon(good)
    assert metrics.value("decode_errors", worker="w", kind="envelope") == 1
    assert metrics.value("resyncs", worker="w", reason="malformed_event") == 1
    (failure,) = [e for e in logs if e["event"] == "kv_event_decode_failed"]
    assert why in failure["reason"]
    bad = decode_envelopes(orjson.dumps([envelope(1, data, hash_algo=algo)]))[0]
    assert isinstance(bad, BadEnvelope) and bad.event_id == 1 and why in bad.reason


def test_hex_and_integer_hashes_never_collide() -> None:
    """A hex hash and the integer of the same digits are different engine blocks."""
    assert engine_key("abcd") != engine_key(0xABCD) == 0xABCD
    assert engine_key("00ab") != engine_key("ab")
    assert engine_key("ff" * 64) > 2**64 and engine_key(2**64 - 1) == 2**64 - 1
    norm, metrics = make()
    out = run(
        norm,
        envelope(0, stored(None, [block(0xABCD, [1, 2, 3, 4])])),
        envelope(1, removed(["abcd"]), hash_algo=V2),  # a mixed stream: not the int block
        envelope(2, removed([0xABCD])),
    )
    assert [type(e) for e in out] == [BlockStored, BlockRemoved]
    assert metrics.value("blocks", worker="w", outcome="unknown_removed") == 1


def test_v1_to_v2_upgrade_is_a_restart() -> None:
    """An engine restarted on the V2 manager (ids from 0) starts over under hex hashes."""
    norm, _ = make()
    tokens = [1, 2, 3, 4]
    run(norm, envelope(0, created()), envelope(1, stored(None, [block(9, tokens)])))
    k = v2_chain(tokens, BS)[0].hex()
    out = v2_run(norm, *v2_opening(), (2, stored(None, [v2_block(k, tokens)]), FULL),
                 (3, removed([k]), FULL))
    assert [type(e) for e in out] == [AllBlocksCleared, BlockStored, BlockRemoved]


def test_v2_digest_tokens_skip_the_block_and_its_children() -> None:
    """A multimodal digest token (hex) hides content: that block and later ones are skipped."""
    norm, metrics = make()
    digest = "ab" * 32
    k = [f"{i:02x}" * 32 for i in range(1, 5)]
    out = v2_run(
        norm,
        (0, created(), FULL),
        (1, stored(None, [v2_block(k[0], [1, 2, 3, 4]), v2_block(k[1], [digest, 9, 9, 9]),
                          v2_block(k[2], [5, 6, 7, 8])]), FULL),
        (2, stored(None, [v2_block(k[3], [digest, 1, 2, 3])]), FULL),
    )
    assert [e.block_hashes for e in out] == [canon([1, 2, 3, 4])]
    assert metrics.value("blocks", worker="w", outcome="skipped") == 2 + 1
    assert metrics.value("decode_errors", worker="w", kind="envelope") == 0


def test_a_better_group_after_published_blocks_resyncs() -> None:
    """Joining mid-stream: blocks of the smaller window were published, then the full-
    attention group shows up; its blocks replace them after a resync."""
    norm, metrics = make()
    k = v2_chain(list(range(1, 9)), BS)
    out = v2_run(
        norm,
        (7, stored(None, [v2_block(k[0].hex(), [1, 2, 3, 4])]), SWA),
        (8, stored(None, [v2_block(k[0].hex(), [1, 2, 3, 4])]), FULL),
        (9, removed([k[0].hex()]), SWA),
    )
    assert [type(e) for e in out] == [BlockStored, AllBlocksCleared, BlockStored]
    assert metrics.value("resyncs", worker="w", reason="indexed_group_changed") == 1
    assert metrics.value("blocks", worker="w", outcome="filtered") == 1


def test_equal_windows_index_the_lowest_layer_group() -> None:
    """Two groups of one window (the same blocks twice): only the lowest group id is kept."""
    norm, metrics = make()
    k = v2_chain([1, 2, 3, 4], BS)[0].hex()
    out = run(norm, *(
        envelope(eid, data, 4096, hash_algo=V2, layer_group_id=group)
        for eid, data, group in [
            (0, created(), 1), (1, created(), 0),
            (2, stored(None, [v2_block(k, [1, 2, 3, 4])]), 1),
            (3, stored(None, [v2_block(k, [1, 2, 3, 4])]), 0),
            (4, removed([k]), 1),
        ]
    ))
    assert [type(e) for e in out] == [BlockStored]
    assert metrics.value("blocks", worker="w", outcome="filtered") == 2


def test_v2_attention_dp_ranks_gathered_on_rank_zero_are_separate_workers() -> None:
    """The V2 manager gathers every rank's events on rank 0, each tagged with its rank and
    counting its own ids: one canonical worker per rank."""
    norm, _ = make(dp_size=2)
    tokens = [1, 2, 3, 4]
    k = v2_chain(tokens, BS)[0].hex()

    def env(eid: int, data: dict, rank: int) -> dict:
        return envelope(eid, data, 4096, rank, hash_algo=V2, layer_group_id=0)

    out = run(
        norm,
        env(0, created(), 0), env(1, stored(None, [v2_block(k, tokens)]), 0),
        env(0, created(), 1), env(1, stored(None, [v2_block(k, tokens)]), 1),
        env(2, removed([k]), 1),
    )
    assert [(e.worker_id, type(e).__name__, e.block_hashes) for e in out] == [
        ("w/dp0", "BlockStored", canon(tokens)),
        ("w/dp1", "BlockStored", canon(tokens)),
        ("w/dp1", "BlockRemoved", canon(tokens)),
    ]


def test_an_event_of_no_group_in_a_grouped_stream_is_about_the_whole_block() -> None:
    """The V2 manager names no group for a removal of the whole block: it always applies; a
    created event of no group does not stop the groups from choosing."""
    norm, metrics = make()
    k = v2_chain([1, 2, 3, 4], BS)[0].hex()
    out = run(norm, *(
        envelope(eid, data, window, hash_algo=V2, layer_group_id=group)
        for eid, data, window, group in [
            (0, created(), 4096, None),
            (1, stored(None, [v2_block(k, [1, 2, 3, 4])]), 128, SWA),
            (2, stored(None, [v2_block(k, [1, 2, 3, 4])]), 4096, FULL),
            (3, removed([k]), 4096, None),
        ]
    ))
    assert [type(e) for e in out] == [BlockStored, AllBlocksCleared, BlockStored, BlockRemoved]
    assert metrics.value("resyncs", worker="w", reason="indexed_group_changed") == 1


def test_v2_objects_from_the_llm_api_decode_the_same() -> None:
    """get_kv_cache_events_async yields the serializer's dicts: the same checks apply."""
    norm, metrics = make()
    tokens = [1, 2, 3, 4]
    k = v2_chain(tokens, BS)[0].hex()
    out = norm.apply_objects([
        envelope(0, created(), 4096, hash_algo=V2, layer_group_id=0),
        envelope(1, stored(None, [v2_block(k, tokens)]), 4096, hash_algo=V2, layer_group_id=0),
        envelope(2, removed([k.upper()]), 4096, hash_algo=V2, layer_group_id=0),
    ])
    assert [type(e) for e in out] == [BlockStored, AllBlocksCleared]
    assert metrics.value("decode_errors", worker="w", kind="envelope") == 1
