"""The shared normalizer: canonical re-hashing, engine-hash keys, resyncs, subsets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.normalize import MalformedEventError, WorkerNormalizer
from adapters.normalize_metrics import AdapterMetrics
from kvcore.events import UNSTAMPED, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kvcore.hashing import BlockHasher
from kvcore.namespace import Namespace
from sidecar.mirror import BlockMirror

BS = 4
MODEL = "m"


def make() -> tuple[WorkerNormalizer, AdapterMetrics]:
    metrics = AdapterMetrics("test")
    return WorkerNormalizer("w", MODEL, BlockHasher(BS), metrics), metrics


def held(out: list[KVEvent]) -> dict[int, int | None]:
    """Every block the events leave held (any tier) → its canonical parent, as the relay's
    mirror sees them."""
    mirror = BlockMirror()
    for event in out:
        mirror.apply(event)
    return {
        h: p
        for tier in mirror.snapshot("w", 0, 0).tiers
        for h, p in zip(tier.block_hashes, tier.parent_hashes, strict=True)
    }


def canon(tokens: list[int], lora: str | None = None, salt: str | None = None) -> list[int]:
    return BlockHasher(BS).hash_tokens(tokens, Namespace(MODEL, lora, salt).seed)


def test_stored_chain_gets_canonical_hashes_of_the_whole_prefix() -> None:
    """A child stored under an engine parent hashes as the continuation of the parent's chain."""
    norm, _ = make()
    out: list[KVEvent] = []
    norm.stored([101, 102], None, list(range(8)), Tier.GPU, out)
    norm.stored([103], 102, list(range(8, 12)), Tier.GPU, out)
    assert [type(e) for e in out] == [BlockStored, BlockStored]
    full = canon(list(range(12)))
    assert out[0].block_hashes == full[:2] and out[0].parent_hash is None
    assert out[1].block_hashes == full[2:] and out[1].parent_hash == full[1]
    assert out[1].token_ids == [8, 9, 10, 11]
    assert [(e.epoch, e.seq) for e in out] == [(UNSTAMPED, UNSTAMPED)] * 2  # the relay stamps


def test_every_stored_chain_is_reported_for_the_store() -> None:
    """``store_names`` hears each chain stored, engine hashes beside canonical ones, the
    partial block left out, on the batched path too."""
    norm, _ = make()
    heard: list[tuple[list[int], list[int], int | None]] = []
    norm.store_names = lambda engine, canonical, parent: heard.append(
        (list(engine), list(canonical), parent))
    out: list[KVEvent] = []
    norm.stored([101, 102, 103], None, list(range(10)), Tier.GPU, out)  # 2 full blocks
    locs = norm.short_chain_locals([(1, list(range(8, 12))), (1, list(range(12, 16)))])
    assert locs is not None
    norm.stored([104], 102, list(range(8, 12)), Tier.GPU, out, locals_=locs[0])
    full = canon(list(range(12)))
    assert heard == [([101, 102], full[:2], None), ([104], full[2:], full[1])]


def test_namespaces_separate_salt_and_lora() -> None:
    """The same tokens under another salt or LoRA get other canonical hashes."""
    norm, _ = make()
    out: list[KVEvent] = []
    norm.stored([1], None, [1, 2, 3, 4], Tier.GPU, out)
    norm.stored([2], None, [1, 2, 3, 4], Tier.GPU, out, cache_salt="t")
    norm.stored([3], None, [1, 2, 3, 4], Tier.GPU, out, lora_name="a")
    hashes = [e.block_hashes[0] for e in out if isinstance(e, BlockStored)]
    assert hashes == [
        canon([1, 2, 3, 4])[0],
        canon([1, 2, 3, 4], salt="t")[0],
        canon([1, 2, 3, 4], lora="a")[0],
    ]
    assert len(set(hashes)) == 3


def test_removal_resolves_engine_hashes_and_counts_unknown() -> None:
    """Removals carry engine hashes; known ones map to canonical, unknown ones are counted."""
    norm, metrics = make()
    out: list[KVEvent] = []
    norm.stored([101, 102], None, list(range(8)), Tier.GPU, out)
    norm.removed([102, 999], Tier.GPU, out)
    assert isinstance(out[-1], BlockRemoved)
    assert out[-1].block_hashes == [canon(list(range(8)))[1]]
    norm.flush_metrics()
    assert metrics.value("blocks", worker="w", outcome="unknown_removed") == 1
    norm.removed([999], Tier.GPU, out)
    assert len(out) == 2  # nothing known: no event


def test_removal_without_tier_finds_each_block() -> None:
    """A tierless removal (TensorRT-LLM) removes each block from the tier that holds it."""
    norm, _ = make()
    out: list[KVEvent] = []
    norm.stored([1], None, [1, 2, 3, 4], Tier.GPU, out)
    norm.stored([2], None, [5, 6, 7, 8], Tier.HOST, out)
    out.clear()
    norm.removed([1, 2], None, out)
    assert {(e.tier, e.block_hashes[0]) for e in out if isinstance(e, BlockRemoved)} == {
        (Tier.GPU, canon([1, 2, 3, 4])[0]),
        (Tier.HOST, canon([5, 6, 7, 8])[0]),
    }
    assert norm.num_blocks() == 0


def test_unknown_parent_orphans_the_chain() -> None:
    """A chain under an engine parent nobody published is counted, never guessed."""
    norm, metrics = make()
    out: list[KVEvent] = []
    norm.stored([5, 6], 12345, list(range(8)), Tier.GPU, out)
    assert out == []
    norm.flush_metrics()
    assert metrics.value("blocks", worker="w", outcome="orphaned") == 2
    norm.stored([7], 6, list(range(4)), Tier.GPU, out)  # child of an orphan: orphan too
    assert out == []


def test_partial_last_block_is_skipped() -> None:
    """A partial tail block is not published; the full ones are."""
    norm, metrics = make()
    out: list[KVEvent] = []
    norm.stored([1, 2], None, list(range(6)), Tier.GPU, out)
    assert out[0].block_hashes == canon(list(range(4)))
    norm.flush_metrics()
    assert metrics.value("blocks", worker="w", outcome="skipped") == 1
    norm.stored([3], 2, list(range(4)), Tier.GPU, out)
    assert len(out) == 1  # its parent was never published


@pytest.mark.parametrize("count", [0, 4, 9, 13])
def test_token_count_that_fits_no_block_count_is_malformed(count: int) -> None:
    """Two blocks of 4 hold 5..8 token ids; anything else raises MalformedEventError."""
    norm, _ = make()
    with pytest.raises(MalformedEventError, match="cannot hold"):
        norm.stored([1, 2], None, list(range(count)), Tier.GPU, [])


def test_parent_found_in_another_tier() -> None:
    """A host-tier child may hang under a parent held only on the GPU."""
    norm, _ = make()
    out: list[KVEvent] = []
    norm.stored([1], None, [1, 2, 3, 4], Tier.GPU, out)
    norm.stored([2], 1, [5, 6, 7, 8], Tier.HOST, out)
    assert out[1].tier is Tier.HOST
    assert out[1].block_hashes == canon([1, 2, 3, 4, 5, 6, 7, 8])[1:]


def test_moved_block_leaves_one_tier_for_another() -> None:
    """A tier move is a removal from the old tier and a store (same hash, parent) in the new."""
    norm, _ = make()
    out: list[KVEvent] = []
    norm.stored([1, 2], None, list(range(8)), Tier.GPU, out)
    norm.moved(2, Tier.GPU, Tier.HOST, out)
    h = canon(list(range(8)))
    assert out[1] == BlockRemoved("w", UNSTAMPED, UNSTAMPED, Tier.GPU, [h[1]])
    assert out[2] == BlockStored("w", UNSTAMPED, UNSTAMPED, Tier.HOST, [h[1]], h[0])


def test_cleared_and_resync() -> None:
    """Cleared empties tiers; a resync forgets everything and says so for the GPU tier."""
    norm, _ = make()
    out: list[KVEvent] = []
    norm.stored([1], None, [1, 2, 3, 4], Tier.HOST, out)
    norm.cleared(None, out)
    assert [e.tier for e in out[1:]] == [Tier.GPU, Tier.HOST]
    assert norm.num_blocks() == 0
    norm.stored([1], None, [1, 2, 3, 4], Tier.GPU, out)
    out.clear()
    norm.resync(out)
    assert out == [AllBlocksCleared("w", UNSTAMPED, UNSTAMPED, Tier.GPU)]
    assert norm.num_blocks() == 0


def test_events_leave_every_held_block_with_its_parent() -> None:
    """The events name every held block with its canonical parent, and nothing removed."""
    norm, _ = make()
    out: list[KVEvent] = []
    norm.stored([1, 2, 3], None, list(range(12)), Tier.GPU, out)
    norm.removed([3], Tier.GPU, out)
    h = canon(list(range(12)))
    assert held(out) == {h[0]: None, h[1]: h[0]}
    assert norm.num_blocks(Tier.GPU) == 2


@st.composite
def histories(draw: st.DrawFn) -> list[tuple]:
    """Random native histories: stores (root or under a live block), removals, clears."""
    ops: list[tuple] = []
    live: list[int] = []
    next_hash = 1
    for _ in range(draw(st.integers(1, 40))):
        kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear"]))
        if kind == "store":
            n = draw(st.integers(1, 5))
            parent = draw(st.sampled_from([None, *live])) if live else None
            tokens = draw(st.lists(st.integers(0, 50), min_size=n * BS, max_size=n * BS))
            hashes = list(range(next_hash, next_hash + n))
            next_hash += n
            live += hashes
            ops.append(("store", hashes, parent, tokens))
        elif kind == "remove" and live:
            gone = draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
            live = [h for h in live if h not in gone]
            ops.append(("remove", gone))
        elif kind == "clear":
            live = []
            ops.append(("clear",))
    return ops


@settings(max_examples=150, deadline=None)
@given(histories())
def test_normalized_state_equals_the_engine_state(ops: list[tuple]) -> None:
    """Whatever the history, the normalizer holds exactly the engine's blocks and its events
    never name a block the engine does not hold: exactly its blocks, hashed canonically, unless
    two engine blocks held the same tokens under the same parent (one canonical block), whose
    removal then takes the canonical block out with the first of them (a subset, never more)."""
    norm, _ = make()
    out: list[KVEvent] = []
    tokens_of: dict[int, tuple[int | None, list[int]]] = {}  # every block ever stored
    live: set[int] = set()
    for op in ops:
        if op[0] == "store":
            _, hashes, parent, tokens = op
            norm.stored(hashes, parent, tokens, Tier.GPU, out)
            prev = parent
            for i, h in enumerate(hashes):
                tokens_of[h] = (prev, tokens[i * BS : (i + 1) * BS])
                prev = h
            live.update(hashes)
        elif op[0] == "remove":
            norm.removed(op[1], Tier.GPU, out)
            live.difference_update(op[1])
        else:
            norm.cleared(None, out)
            live.clear()

    def path(h: int | None) -> list[int]:
        parts: list[list[int]] = []
        while h is not None:
            h, block_tokens = tokens_of[h]
            parts.append(block_tokens)
        return [t for part in reversed(parts) for t in part]

    want = {}
    for h in live:
        chain = canon(path(h))
        want[chain[-1]] = chain[-2] if len(chain) > 1 else None
    assert norm.num_blocks() == len(live)
    got = held(out)
    assert got.items() <= want.items()
    if len({canon(path(h))[-1] for h in tokens_of}) == len(tokens_of):  # no shared blocks
        assert got == want
