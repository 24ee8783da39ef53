"""vLLM wire decoding and batch normalization over frames encoded as vLLM encodes them."""

from __future__ import annotations

import msgspec
import pytest

from adapters.normalize import WorkerNormalizer
from adapters.normalize_metrics import AdapterMetrics
from adapters.vllm.core import VllmRankNormalizer
from adapters.vllm.wire import VlBlockRemoved, VlBlockStored, decode_batch, decode_batch_lenient
from adapters.zmq_events.batches import BlockSizeMismatchError
from adapters.zmq_events.framing import BadEvent
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kvcore.hashing import BlockHasher
from kvcore.namespace import Namespace
from tests.unit.adapters import vllm_fixtures as vl

BS = 4


def core(lora_names: dict[int, str] | None = None) -> VllmRankNormalizer:
    metrics = AdapterMetrics("vllm")
    norm = WorkerNormalizer("w", "m", BlockHasher(BS), metrics)
    return VllmRankNormalizer(norm, metrics, lora_names)


def apply(c: VllmRankNormalizer, seq: int, *events: vl.KVCacheEvent) -> list[KVEvent]:
    out: list[KVEvent] = []
    assert c.apply(seq, vl.batch(*events), out)
    return out


def h(tokens: list[int], lora: str | None = None, salt: str | None = None) -> list[int]:
    return BlockHasher(BS).hash_tokens(tokens, Namespace("m", lora, salt).seed)


def test_typed_decode_reads_every_field_vllm_sends() -> None:
    """A batch as vLLM encodes it (array batch, tagged map events) decodes on the fast path."""
    payload = vl.batch(
        vl.stored([1, 2], None, list(range(8)), BS, lora_name="a", extra_keys=[("a",), ("a",)],
                  group_idx=0, kv_cache_spec_kind="full_attention"),
        vl.BlockRemoved([2], "CPU"),
        vl.AllBlocksCleared(),
        rank=3,
    )
    got = decode_batch(payload)
    assert got.data_parallel_rank == 3
    first = got.events[0]
    assert isinstance(first, VlBlockStored)
    assert (first.block_hashes, first.lora_name, first.extra_keys) == ([1, 2], "a", [["a"], ["a"]])
    assert got.events[1] == VlBlockRemoved([2], "CPU")


def test_lenient_decode_takes_bytes_hashes_and_old_layouts() -> None:
    """Bytes hashes become vLLM's integer form; array-like events and map batches decode;
    an unknown event is a BadEvent, the rest survive."""
    digest = bytes(range(32))
    payload = vl.batch(vl.stored([digest], None, [1, 2, 3, 4], BS), vl.BlockRemoved([digest], None))
    with pytest.raises(msgspec.ValidationError):
        decode_batch(payload)
    _, events, _ = decode_batch_lenient(payload)
    want = int.from_bytes(digest, "big") & ((1 << 64) - 1)
    assert [e.block_hashes for e in events if not isinstance(e, BadEvent)] == [[want], [want]]
    legacy = msgspec.msgpack.encode(vl.LegacyBatch(1.0, [vl.LegacyBlockRemoved([7], "GPU")]))
    assert decode_batch_lenient(legacy)[1] == [VlBlockRemoved([7], "GPU")]
    as_map = msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "Teleported"}]})
    (bad,) = decode_batch_lenient(as_map)[1]
    assert isinstance(bad, BadEvent) and "Teleported" in bad.reason


def test_a_duplicate_store_needs_two_removals() -> None:
    """A hash stored twice (a fully cached prompt's re-filled block) stays until both copies
    are removed."""
    c = core()
    tokens = [1, 2, 3, 4]
    apply(c, 0, vl.stored([9], None, tokens, BS))
    apply(c, 1, vl.stored([9], None, tokens, BS))
    assert apply(c, 2, vl.BlockRemoved([9], "GPU")) == []
    assert apply(c, 3, vl.BlockRemoved([9], "GPU")) == [
        BlockRemoved("w", 0, 0, Tier.GPU, h(tokens))
    ]
    assert c.normalizer.num_blocks() == 0


def test_copies_are_forgotten_with_the_state() -> None:
    """After AllBlocksCleared (or a resync) an old duplicate no longer swallows a removal."""
    c = core()
    apply(c, 0, vl.stored([9], None, [1, 2, 3, 4], BS), vl.stored([9], None, [1, 2, 3, 4], BS))
    apply(c, 1, vl.AllBlocksCleared())
    apply(c, 2, vl.stored([9], None, [1, 2, 3, 4], BS))
    assert [type(e) for e in apply(c, 3, vl.BlockRemoved([9], "GPU"))] == [BlockRemoved]


def test_medium_names_the_tier_and_lora_the_namespace() -> None:
    """CPU blocks (the offloading connector's) are the host tier; a LoRA id without a name
    takes --lora-adapter's name."""
    c = core({7: "ad"})
    out = apply(c, 0, vl.stored([1], None, [1, 2, 3, 4], BS, medium="CPU", lora_id=7))
    assert out == [BlockStored("w", 0, 0, Tier.HOST, h([1, 2, 3, 4], "ad"), None, [1, 2, 3, 4])]


def test_extra_keys_give_the_salt_and_hide_multimodal_blocks() -> None:
    """The first block's one extra key is the cache salt; a block with multimodal keys and
    the rest of its chain are skipped."""
    c = core()
    out = apply(c, 0, vl.stored([1, 2], None, list(range(8)), BS, extra_keys=[("salt",), None]))
    assert out[0].block_hashes == h(list(range(8)), salt="salt")  # type: ignore[attr-defined]
    out = apply(c, 1, vl.stored([3, 4], 2, list(range(8, 16)), BS,
                                extra_keys=[None, ("mm-hash", 0)]))
    assert out[0].block_hashes == h(list(range(12)), salt="salt")[2:]  # type: ignore[attr-defined]
    assert c.normalizer.num_blocks() == 3


def test_only_one_kv_cache_group_is_indexed() -> None:
    """A hybrid model's sliding-window group is filtered; the full-attention group indexed."""
    c = core()
    apply(c, 0, vl.stored([1], None, [1, 2, 3, 4], BS, group_idx=1,
                          kv_cache_spec_sliding_window=128))
    apply(c, 1, vl.stored([1], None, [1, 2, 3, 4], BS, group_idx=0))
    assert apply(c, 2, vl.BlockRemoved([1], "GPU", group_idx=1)) == []
    assert c.normalizer.num_blocks() == 1


def test_a_foreign_block_size_is_a_misconfiguration() -> None:
    with pytest.raises(BlockSizeMismatchError, match="--block-size 16"):
        apply(core(), 0, vl.stored([1], None, list(range(16)), 16))


def test_a_bad_event_is_counted_once_and_the_rest_applied() -> None:
    c = core()
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "Teleported"}, {"type": "AllBlocksCleared"}], 0]
    )
    out: list[KVEvent] = []
    assert not c.apply(5, payload, out)
    assert not c.apply(5, payload, [])
    assert [type(e) for e in out] == [AllBlocksCleared]
    assert c.metrics.value("decode_errors", worker="w", kind="event") == 1
