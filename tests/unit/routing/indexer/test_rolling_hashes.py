"""The RFC's XXH3-64 rolling hashes, and their translation table fed by the prefix index: the
scheme spelled out byte by byte, the lifetime of each entry, and /query_by_hash answering as
/query does for any history of stores and removals."""

from __future__ import annotations

import struct

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore import BlockHasher, namespace_seed
from kvcore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Tier,
    TierBlocks,
    WorkerSnapshot,
)
from kvcore.wire import decode
from routing.indexer.answer import Rank, answer_query
from routing.indexer.rolling_hashes import DEFAULT_XXH3_SEED, RollingHashMap, rolling_hashes
from routing.placement.prefix_index import PrefixIndex
from sidecar.relay import EventRelay

BS = 4
HASHER = BlockHasher(BS)
NS = namespace_seed("m")
TOKENS = [101, 15, 100, 55, 89, 7, 70000, 3, 1 << 31, 0, 4, 2]  # 3 full blocks


def test_the_rfc_scheme_byte_by_byte() -> None:
    """local = XXH3(u32 LE tokens, S); seq[0] = local[0]; seq[i] = XXH3(seq[i-1] LE u64 ||
    local[i] LE u64, S), only full blocks; pinned by golden values of seed 1337."""
    seed = DEFAULT_XXH3_SEED
    local = [xxhash.xxh3_64_intdigest(struct.pack("<4I", *TOKENS[i:i + 4]), seed)
             for i in range(0, 12, 4)]
    seq = [local[0]]
    for block_local in local[1:]:
        seq.append(xxhash.xxh3_64_intdigest(struct.pack("<QQ", seq[-1], block_local), seed))
    assert rolling_hashes([*TOKENS, 9, 9], BS, seed) == seq
    assert rolling_hashes(TOKENS[4:], BS, seed, parent=seq[0]) == seq[1:]
    assert rolling_hashes(TOKENS, BS, 0) != seq
    assert seq == [0x17257CA1260EE563, 0x3B445F83F57AC2DB, 0xE651D7C807D76E8B]
    assert xxhash.xxh3_64_intdigest(b"", 0) == 0x2D06800538D394C2  # xxHash's own test vector
    assert rolling_hashes(TOKENS[:3], BS, seed) == []


def test_root_seed_recovers_the_namespace_of_a_chain() -> None:
    """A first block's hash and tokens give back the namespace seed it was hashed under."""
    for hasher in (HASHER, BlockHasher(5), BlockHasher(1)):
        size = hasher.block_size
        for ns in (NS, namespace_seed("m", "lora", "salt"), 0, (1 << 64) - 1):
            first = hasher.hash_tokens(TOKENS, ns)[0]
            assert hasher.root_seed(first, TOKENS[:size]) == ns


def indexed() -> tuple[PrefixIndex, RollingHashMap]:
    index = PrefixIndex()
    rolling = RollingHashMap()
    index.observer = rolling
    return index, rolling


def stored(worker: str, seq: int, tokens: list[int], ns: int = NS, tier: Tier = Tier.GPU,
           *, skip: int = 0, with_tokens: bool = True, epoch: int = 1) -> BlockStored:
    """Blocks ``skip..`` of ``tokens``' chain, under their parent (as an engine stores them)."""
    chain = HASHER.hash_tokens(tokens, ns)
    parent = chain[skip - 1] if skip else None
    return BlockStored(worker, epoch, seq, tier, chain[skip:], parent,
                       tokens[skip * BS:len(chain) * BS] if with_tokens else None)


def xxh3(tokens: list[int]) -> list[int]:
    return rolling_hashes(tokens, BS, DEFAULT_XXH3_SEED)


def test_stored_chains_translate_under_their_namespace_only() -> None:
    """A chain stored in two events translates whole; the same tokens in another namespace
    (LoRA, salt) translate to that namespace's own blocks, never across."""
    index, rolling = indexed()
    index.apply(stored("w", 1, TOKENS[:8]))
    index.apply(stored("w", 2, TOKENS, skip=2))
    salted = namespace_seed("m", None, "w8a8")
    index.apply(stored("w", 3, TOKENS, salted))
    assert rolling.canonical(NS, xxh3(TOKENS)) == HASHER.hash_tokens(TOKENS, NS)
    assert rolling.canonical(salted, xxh3(TOKENS)) == HASHER.hash_tokens(TOKENS, salted)
    assert rolling.canonical(namespace_seed("m", "lora"), xxh3(TOKENS)) == []
    other = [1, 2, 3, 4, *TOKENS[4:]]
    assert rolling.canonical(NS, xxh3(other)) == []  # block 0 differs: nothing after counts
    assert rolling.canonical(NS, [*xxh3(TOKENS)[:2], 12345]) == HASHER.hash_tokens(TOKENS, NS)[:2]


def test_an_entry_lives_while_a_worker_and_tier_holds_its_block() -> None:
    """Evictions, cleared tiers, a worker gone or restarted take the translation away with
    the last holder; a second holder keeps it."""
    index, rolling = indexed()
    chain = HASHER.hash_tokens(TOKENS, NS)
    index.apply(stored("a", 1, TOKENS))
    index.apply(stored("b", 1, TOKENS[:8]))
    index.apply(stored("a", 2, TOKENS, tier=Tier.HOST))
    index.apply(BlockRemoved("a", 1, 3, Tier.GPU, [chain[2]]))
    assert rolling.canonical(NS, xxh3(TOKENS)) == chain  # a still holds block 2 on the host
    index.apply(AllBlocksCleared("a", 1, 4, Tier.HOST))
    assert rolling.canonical(NS, xxh3(TOKENS)) == chain[:2]
    index.apply(BlockRemoved("a", 1, 5, Tier.GPU, chain[:2]))
    assert rolling.canonical(NS, xxh3(TOKENS)) == chain[:2]  # b holds them
    index.remove_worker("b")
    assert rolling.canonical(NS, xxh3(TOKENS)) == [] and len(rolling) == 0
    index.apply(stored("a", 6, TOKENS))
    index.apply(stored("a", 1, TOKENS[:4], epoch=2))  # restarted: only what it stores anew
    assert rolling.canonical(NS, xxh3(TOKENS)) == chain[:1] and len(rolling) == 1


def test_duplicate_removals_and_stale_events_count_once() -> None:
    """A block removed twice, a duplicate event, a removal of what was never held: the
    holders' count stays exact."""
    index, rolling = indexed()
    chain = HASHER.hash_tokens(TOKENS, NS)
    index.apply(stored("a", 1, TOKENS))
    index.apply(stored("a", 1, TOKENS))  # duplicate seq: not applied
    index.apply(stored("b", 1, TOKENS))
    index.apply(BlockRemoved("a", 1, 2, Tier.GPU, chain))
    index.apply(BlockRemoved("a", 1, 3, Tier.GPU, chain))
    index.apply(BlockRemoved("a", 1, 4, Tier.HOST, chain))
    assert rolling.canonical(NS, xxh3(TOKENS)) == chain
    index.apply(BlockRemoved("b", 1, 2, Tier.GPU, chain))
    assert len(rolling) == 0


def test_blocks_without_tokens_and_under_unknown_parents() -> None:
    """A tier move without tokens holds a known block; an unknown one is counted
    untranslated. A block stored under a parent whose hash is unknown waits for it, with its
    tokens, and is translated when the parent is stored again."""
    index, rolling = indexed()
    chain = HASHER.hash_tokens(TOKENS, NS)
    index.apply(stored("a", 1, TOKENS[:8]))
    index.apply(BlockStored("a", 1, 2, Tier.HOST, chain[:1], None))  # offloaded: no tokens
    index.apply(BlockRemoved("a", 1, 3, Tier.GPU, chain[:2]))
    assert rolling.canonical(NS, xxh3(TOKENS)) == chain[:1]
    index.apply(stored("a", 4, TOKENS, skip=2, with_tokens=False))
    assert rolling.blocks_untranslated == 1
    index.apply(stored("b", 1, TOKENS, skip=2))  # its parent's XXH3 hash is gone
    assert rolling.canonical(NS, xxh3(TOKENS)) == chain[:1]
    index.apply(stored("c", 1, TOKENS[:8], skip=1))
    assert rolling.canonical(NS, xxh3(TOKENS)) == chain
    index.remove_worker("b")
    index.remove_worker("c")
    index.apply(stored("b", 2, TOKENS, skip=2))  # waits again, then goes with its holder
    index.remove_worker("b")
    assert rolling.canonical(NS, xxh3(TOKENS)) == chain[:1] and len(rolling) == 1


def test_a_resync_keeps_what_the_snapshot_still_lists() -> None:
    """A snapshot replaces a worker's blocks: those it lists keep (or, when known from
    another holder, gain) their translation; the rest lose it."""
    index, rolling = indexed()
    chain = HASHER.hash_tokens(TOKENS, NS)
    index.apply(stored("a", 1, TOKENS))
    index.apply(stored("b", 1, TOKENS[:4]))
    index.load_worker_snapshot(WorkerSnapshot("a", 1, 9, [
        TierBlocks(Tier.GPU, chain[:2], [None, chain[0]])]))
    assert rolling.canonical(NS, xxh3(TOKENS)) == chain[:2]
    index.load_worker_snapshot(WorkerSnapshot("b", 1, 9, [
        TierBlocks(Tier.HOST, chain[:2], [None, chain[0]])]))  # b now counts block 1 too
    index.remove_worker("a")
    assert rolling.canonical(NS, xxh3(TOKENS)) == chain[:2]
    index.load_image(PrefixIndex().to_image())  # an image carries no tokens
    assert len(rolling) == 0


def late_index(relays: dict[str, EventRelay]) -> tuple[PrefixIndex, RollingHashMap]:
    """An index that first hears of the relays' workers through their snapshots (a gateway
    subscribing to warm sidecars), over the wire."""
    index, rolling = indexed()
    for relay in relays.values():
        snapshot = decode(relay.plan(None, None).backlog[0])
        assert isinstance(snapshot, WorkerSnapshot)
        index.load_worker_snapshot(snapshot)
    return index, rolling


def test_a_snapshot_with_token_ids_translates_its_blocks() -> None:
    """A warm worker's snapshot teaches the blocks' XXH3 hashes: chains stored in several
    events, a block listed before its parent (stored again after its child), another tier,
    another namespace."""
    relay = EventRelay("a", block_size=BS, model_id="m", epoch=1)
    chain = HASHER.hash_tokens(TOKENS, NS)
    salted = namespace_seed("m", None, "w8a8")
    relay.publish(stored("a", 0, TOKENS[:8]))
    relay.publish(stored("a", 0, TOKENS, skip=2))
    relay.publish(BlockRemoved("a", 0, 0, Tier.GPU, chain[1:2]))
    relay.publish(stored("a", 0, TOKENS[:8], skip=1))  # block 1 now follows its child
    relay.publish(stored("a", 0, TOKENS[:8], tier=Tier.HOST))
    relay.publish(stored("a", 0, TOKENS, salted))
    index, rolling = late_index({"a": relay})
    assert rolling.canonical(NS, xxh3(TOKENS)) == chain
    assert rolling.canonical(salted, xxh3(TOKENS)) == HASHER.hash_tokens(TOKENS, salted)
    assert rolling.num_translated("a") == 3 + 2 + 3 and rolling.blocks_untranslated == 0
    index.apply(BlockRemoved("a", 1, 7, Tier.GPU, chain))
    assert rolling.canonical(NS, xxh3(TOKENS)) == chain[:2]  # the host tier holds two


def test_a_snapshot_without_token_ids_is_counted_untranslated() -> None:
    """An older sidecar's snapshot (no token ids) is found by /query, not by XXH3 hashes,
    and says so in blocks_untranslated; the blocks translate once stored again."""
    index, rolling = indexed()
    chain = HASHER.hash_tokens(TOKENS, NS)
    index.load_worker_snapshot(WorkerSnapshot("a", 1, 9, [
        TierBlocks(Tier.GPU, chain, [None, *chain[:2]])]))
    assert rolling.canonical(NS, xxh3(TOKENS)) == [] and rolling.blocks_untranslated == 3
    assert index.match(chain) == {"a": 3}
    index.apply(stored("a", 10, TOKENS))
    assert rolling.canonical(NS, xxh3(TOKENS)) == chain


def test_a_self_parented_first_block_is_skipped_as_the_index_skips_it() -> None:
    """An event whose first block is its own parent: that block is not stored again."""
    index, rolling = indexed()
    chain = HASHER.hash_tokens(TOKENS, NS)
    index.apply(stored("a", 1, TOKENS[:4]))
    index.apply(BlockStored("a", 1, 2, Tier.GPU, chain[:2], chain[0], TOKENS[:8]))
    index.apply(BlockRemoved("a", 1, 3, Tier.GPU, chain[:1]))
    assert rolling.canonical(NS, xxh3(TOKENS)) == []
    assert rolling.canonical(NS, xxh3(TOKENS)[1:2]) == chain[1:2]


PROMPTS = [TOKENS, [*TOKENS[:8], 5, 6, 7, 8], [9, 9, 9, 9, *TOKENS[4:]], TOKENS[:4]]
_event = st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(list(Tier)[:2]),
                   st.integers(0, len(PROMPTS) - 1), st.integers(0, 2), st.integers(1, 3),
                   st.sampled_from(["store", "remove", "clear"]))


@settings(max_examples=60, deadline=None)
@given(st.lists(_event, max_size=25))
def test_query_by_hash_answers_as_query_after_any_history(history: list[tuple]) -> None:  # type: ignore[type-arg]
    """For any stores (partial chains continuing their parents), removals and clears on two
    workers and two tiers, every prompt's XXH3 hashes answer exactly as its token ids."""
    index, rolling = indexed()
    seqs = {"a": 0, "b": 0}
    for worker, tier, p, skip, count, kind in history:
        tokens = PROMPTS[p]
        chain = HASHER.hash_tokens(tokens, NS)
        seqs[worker] += 1
        seq = seqs[worker]
        event: KVEvent
        if kind == "store":
            end = min(skip + count, len(chain))
            if skip >= end:
                continue
            event = stored(worker, seq, tokens[:end * BS], tier=tier, skip=skip)
        elif kind == "remove":
            event = BlockRemoved(worker, 1, seq, tier, chain[skip:skip + count])
        else:
            event = AllBlocksCleared(worker, 1, seq, tier)
        index.apply(event)
    instances = {"i": [Rank(0, "a"), Rank(1, "b")]}
    for tokens in PROMPTS:
        by_tokens = answer_query(index, HASHER.hash_tokens(tokens, NS), BS, instances)
        translated = rolling.canonical(NS, xxh3(tokens))
        assert answer_query(index, translated, BS, instances) == by_tokens
    index.remove_worker("a")
    index.remove_worker("b")
    assert len(rolling) == 0 and not rolling._waiting and not rolling._canonical  # no leak


@settings(max_examples=60, deadline=None)
@given(st.lists(_event, max_size=25))
def test_a_late_index_from_snapshots_answers_query_by_hash_as_query(history: list[tuple]) -> None:  # type: ignore[type-arg]
    """For any history on two workers' sidecars, an index that starts from their snapshots
    answers every prompt's XXH3 hashes exactly as its token ids, and as an index that saw
    every event does."""
    live, _ = indexed()
    relays = {w: EventRelay(w, block_size=BS, model_id="m", epoch=1) for w in ("a", "b")}
    for worker, tier, p, skip, count, kind in history:
        tokens = PROMPTS[p]
        chain = HASHER.hash_tokens(tokens, NS)
        event: KVEvent
        if kind == "store":
            end = min(skip + count, len(chain))
            if skip >= end:
                continue
            event = stored(worker, 0, tokens[:end * BS], tier=tier, skip=skip)
        elif kind == "remove" and chain[skip:skip + count]:
            event = BlockRemoved(worker, 0, 0, tier, chain[skip:skip + count])
        elif kind == "clear":
            event = AllBlocksCleared(worker, 0, 0, tier)
        else:
            continue
        frame = relays[worker].publish(event)
        live.apply(decode(frame))  # type: ignore[arg-type]
    index, rolling = late_index(relays)
    instances = {"i": [Rank(0, "a"), Rank(1, "b")]}
    for tokens in PROMPTS:
        by_tokens = answer_query(index, HASHER.hash_tokens(tokens, NS), BS, instances)
        assert by_tokens == answer_query(live, HASHER.hash_tokens(tokens, NS), BS, instances)
        translated = rolling.canonical(NS, xxh3(tokens))
        assert answer_query(index, translated, BS, instances) == by_tokens
