"""Canonical events as vLLM's KV events: vLLM's block hashes, recomputed from token ids."""

from __future__ import annotations

import hashlib
from typing import Any

import cbor2
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from adapters.vllm.block_hash import VllmBlockHasher, VllmHashAlgo, cbor, external_hash
from adapters.vllm.republish import CANONICAL, VllmEventWriter
from adapters.vllm.wire import VlBlockRemoved, VlBlockStored, decode_batch, encode_batch
from kvcore.events import UNSTAMPED, AllBlocksCleared, BlockRemoved, BlockStored, Tier
from kvcore.hashing import BlockHasher
from kvcore.namespace import namespace_seed

BS = 4
OURS = BlockHasher(BS)
MODEL = "tiny"


def vllm_reference(tokens: list[int], seed: str, digest: Any = hashlib.sha256) -> list[int]:
    """vLLM's ``hash_block_tokens`` chain as documented, with cbor2: NONE_HASH is
    H(cbor(PYTHONHASHSEED)), each block H(cbor((parent, tuple(tokens), None)))."""
    def h(x: object) -> bytes:
        data = cbor2.dumps(x, canonical=True)
        return bytes(digest(data).digest())

    parent, out = h(seed), []
    for i in range(0, len(tokens) - BS + 1, BS):
        parent = h((parent, tuple(tokens[i : i + BS]), None))
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


def stored(tokens: list[int], parent: int | None = None, tier: Tier = Tier.GPU,
           ns: int | None = None) -> BlockStored:
    hashes = OURS.hash_tokens(tokens, namespace_seed(MODEL) if ns is None else ns, parent)
    return BlockStored("w", UNSTAMPED, UNSTAMPED, tier, hashes, parent, tokens)


@given(st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 64), (1 << 64) - 1) | st.binary()
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.tuples(inner, inner),
    max_leaves=20,
))
def test_cbor_matches_cbor2_canonical(value: object) -> None:
    """Our CBOR writer is byte for byte cbor2's canonical encoding."""
    assert cbor(value) == cbor2.dumps(value, canonical=True)


@pytest.mark.parametrize("algo", list(VllmHashAlgo))
def test_block_hasher_matches_vllm_algorithm(algo: VllmHashAlgo) -> None:
    """The chain is vLLM's: seeded NONE_HASH, (parent, tokens, None) preimages, low 64 bits."""
    digest = hashlib.sha256 if algo is VllmHashAlgo.SHA256_CBOR else xxhash.xxh3_128
    tokens = [7, 300, 70000, 1 << 20, 5, 6, 7, 8, 9, 10, 11]  # the last block is partial
    hasher = VllmBlockHasher(algo, BS, "42")
    got = [external_hash(d) for d in hasher.chain(None, tokens)]
    assert got == vllm_reference(tokens, "42", digest)
    assert len(got) == 2


def test_writer_rehashes_chains_and_removals() -> None:
    """A chain, its continuation and their removal carry vLLM's hashes, consistently."""
    writer = VllmEventWriter(MODEL, BS, VllmHashAlgo.SHA256_CBOR, "0")
    tokens = list(range(100, 124))
    first = stored(tokens[:8])
    second = stored(tokens[8:], parent=first.block_hashes[-1])
    want = vllm_reference(tokens, "0")
    [a] = writer.translate(first)
    [b] = writer.translate(second)
    assert isinstance(a, VlBlockStored) and isinstance(b, VlBlockStored)
    assert a.block_hashes == want[:2] and a.parent_block_hash is None
    assert b.block_hashes == want[2:] and b.parent_block_hash == want[1]
    assert a.token_ids == tokens[:8] and a.block_size == BS and a.medium == "GPU"
    [gone] = writer.translate(BlockRemoved("w", 0, 0, Tier.GPU, second.block_hashes[:1]))
    assert isinstance(gone, VlBlockRemoved) and gone.block_hashes == want[2:3]
    [rest] = writer.translate(AllBlocksCleared("w", 0, 0, Tier.GPU))
    assert isinstance(rest, VlBlockRemoved)
    assert sorted(rest.block_hashes) == sorted(want[:2] + want[3:])
    assert writer.translate(AllBlocksCleared("w", 0, 0, Tier.GPU)) == []


def test_writer_leaves_out_what_it_cannot_hash() -> None:
    """No tokens, an unknown parent or another namespace's first block: counted, not sent."""
    writer = VllmEventWriter(MODEL, BS, VllmHashAlgo.SHA256_CBOR, "0")
    bare = stored(list(range(8)))
    bare = BlockStored("w", 0, 0, Tier.GPU, bare.block_hashes, None, None)
    assert writer.translate(bare) == []
    assert writer.translate(stored(list(range(4)), parent=12345)) == []
    lora = stored(list(range(8)), ns=namespace_seed(MODEL, "my-lora"))
    assert writer.translate(lora) == []
    assert writer.skipped == {"no_tokens": 2, "orphaned": 1, "namespaced": 2}
    assert writer.translate(BlockRemoved("w", 0, 0, Tier.GPU, lora.block_hashes)) == []


def test_tiers_are_kept_apart() -> None:
    """A host-tier copy is stored and removed under its own medium."""
    writer = VllmEventWriter(MODEL, BS, VllmHashAlgo.SHA256_CBOR, "0")
    tokens = list(range(8))
    writer.translate(stored(tokens))
    [host] = writer.translate(stored(tokens, tier=Tier.HOST))
    assert isinstance(host, VlBlockStored) and host.medium == "CPU"
    [gone] = writer.translate(AllBlocksCleared("w", 0, 0, Tier.HOST))
    assert isinstance(gone, VlBlockRemoved) and gone.medium == "CPU"
    assert gone.block_hashes == vllm_reference(tokens, "0")


def test_canonical_passes_our_hashes_through() -> None:
    """``canonical`` publishes our own hashes, parents included."""
    writer = VllmEventWriter(MODEL, BS, CANONICAL)
    first = stored(list(range(8)))
    second = stored(list(range(8, 12)), parent=first.block_hashes[-1])
    [a] = writer.translate(first)
    [b] = writer.translate(second)
    assert isinstance(a, VlBlockStored) and isinstance(b, VlBlockStored)
    assert a.block_hashes == first.block_hashes
    assert b.parent_block_hash == first.block_hashes[-1]


def test_batches_round_trip_through_our_vllm_decoder() -> None:
    """What the writer emits decodes with the vLLM adapter's own typed decoder."""
    writer = VllmEventWriter(MODEL, BS, VllmHashAlgo.SHA256_CBOR, "0")
    events = writer.translate(stored(list(range(8))))
    batch = decode_batch(encode_batch(1.5, events, 0))
    assert batch.events == events and batch.data_parallel_rank == 0
