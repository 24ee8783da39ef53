"""Batched hashing of short chains equals BlockHasher, and the adapters' batched paths agree."""

from __future__ import annotations

import msgspec
import numpy as np
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.normalize import WorkerNormalizer
from adapters.normalize_hashing import _np_fmix64_inverse, block_locals, chain_from_locals
from adapters.normalize_metrics import AdapterMetrics
from adapters.sglang.core import RankNormalizer
from adapters.trtllm.adapter import TrtllmNormalizer
from kvcore.events import BlockStored, KVEvent, Tier
from kvcore.hashing import BlockHasher, fmix64_inverse
from kvcore.namespace import Namespace
from tests.unit.adapters import trtllm_fixtures as trt

u64 = st.integers(0, 2**64 - 1)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 9),
    st.integers(0, 6),
    u64,
    st.one_of(st.none(), u64),
    st.data(),
)
def test_chain_from_locals_equals_hash_tokens(
    bs: int, n: int, seed: int, parent: int | None, data: st.DataObject
) -> None:
    """Locals from one chained pass re-chain to exactly what hash_tokens computes."""
    hasher = BlockHasher(bs)
    tokens = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=n * bs, max_size=n * bs))
    assert chain_from_locals(block_locals(hasher, tokens), seed, parent) == hasher.hash_tokens(
        tokens, seed, parent
    )


@settings(max_examples=50, deadline=None)
@given(st.lists(u64, min_size=1, max_size=64))
def test_vectorized_fmix64_inverse_equals_the_scalar_one(values: list[int]) -> None:
    """The numpy inversion used by block_locals matches hashing.fmix64_inverse bit for bit."""
    values += [0, 1, 2**63, 2**64 - 1]
    got = _np_fmix64_inverse(np.array(values, dtype=np.uint64)).tolist()
    assert got == [fmix64_inverse(v) for v in values]


def sg_stored(h: int | list[int], parent: int | None, tokens: list[int]) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": h if isinstance(h, list) else [h],
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
    }


def sg_events(batches: list[list[dict]]) -> list[KVEvent]:
    metrics = AdapterMetrics("sglang")
    core = RankNormalizer(WorkerNormalizer("w", "m", BlockHasher(4), metrics), metrics)
    out: list[KVEvent] = []
    for seq, events in enumerate(batches):
        core.apply(seq, msgspec.msgpack.encode([0.0, events, 0]), out)
    return out


def test_sglang_batch_of_short_chains_matches_one_event_per_batch() -> None:
    """Many one-page events in one batch (batched hashing) normalize like separate batches."""
    events = [sg_stored(1, None, [1, 2, 3, 4])]
    events += [sg_stored(i, i - 1, [i] * 4) for i in range(2, 12)]
    events += [sg_stored([50, 51], None, [7, 7, 7, 7, 8, 8])]  # a partial tail block
    events += [sg_stored(70, 5, [9, 9, 9, 9])]
    assert sg_events([events]) == sg_events([[e] for e in events])
    assert len(sg_events([events])) == 13
    norm = WorkerNormalizer("w", "m", BlockHasher(4))
    chains = [(len(e["block_hashes"]), e["token_ids"]) for e in events]
    assert norm.short_chain_locals(chains) is not None  # the batched path was taken
    # An invalid token id makes the batch fall back to per-event hashing: only it is lost.
    bad = [*events, sg_stored(60, None, [1, 2, 3, 2**32])]
    assert norm.short_chain_locals([(1, bad[-1]["token_ids"]), *chains]) is None
    assert sg_events([bad]) == sg_events([events])


def test_trtllm_answer_of_short_chains_matches_one_envelope_per_answer() -> None:
    """Many short stored envelopes in one answer normalize like one envelope per answer."""
    envs = [trt.envelope(0, trt.stored(None, [trt.block(1, [1, 2, 3, 4])]))]
    envs += [
        trt.envelope(i - 1, trt.stored(i - 1, [trt.block(i, [i] * 4), trt.block(100 + i, [i, i])]))
        for i in range(2, 9)
    ]
    envs += [
        trt.envelope(
            8, trt.stored(None, [trt.block(20, [5] * 4), trt.block(21, [6] * 4, cache_level=1)])
        )
    ]

    def run(answers: list[list[dict]]) -> list[KVEvent]:
        norm = TrtllmNormalizer("w", "m", 4, 1, AdapterMetrics("trtllm"))
        out: list[KVEvent] = []
        for answer in answers:
            out += norm.apply_payload(orjson.dumps(answer))
        return out

    batched = run([envs])
    assert batched == run([[e] for e in envs])
    assert len(batched) == 1 + 7 + 2


def test_children_continue_from_kept_chain_states_or_invert_the_parent() -> None:
    """A child of a batched block reuses its chain state; other parents are inverted."""
    hasher = BlockHasher(4)
    seed = Namespace("m").seed
    norm = WorkerNormalizer("w", "m", hasher)
    out: list[KVEvent] = []
    tokens = [[i, i + 1, i + 2, i + 3] for i in range(0, 40, 4)]
    norm.stored([1, 2], None, tokens[0] + tokens[1], Tier.GPU, out)  # per-event hashing
    for start in (2, 4, 6):  # one-block chains, batched in twos, under the previous block
        pair = tokens[start : start + 2]
        locs = norm.short_chain_locals([(1, t) for t in pair])
        assert locs is not None
        for i, (t, loc) in enumerate(zip(pair, locs, strict=True)):
            norm.stored([start + i + 1], start + i, t, Tier.GPU, out, locals_=loc)
    locs = norm.short_chain_locals([(2, tokens[8] + tokens[9]), (1, [7, 7, 7, 7])])
    assert locs is not None
    norm.stored([9, 10], 8, tokens[8] + tokens[9], Tier.HOST, out, locals_=locs[0])
    norm.stored([11], 10, [7, 7, 7, 7], Tier.GPU, out, locals_=locs[1])  # parent in HOST
    expected = hasher.hash_tokens([tok for t in tokens for tok in t] + [7, 7, 7, 7], seed)
    got = [h for e in out if isinstance(e, BlockStored) for h in e.block_hashes]
    assert got == expected
    gpu_parents = [
        parent
        for e in out
        if isinstance(e, BlockStored) and e.tier is Tier.GPU
        for parent in [e.parent_hash, *e.block_hashes[:-1]]
    ]
    assert gpu_parents == [None, *expected[:7], expected[9]]
