"""The prefix index's behaviour on specific event sequences."""

from __future__ import annotations

import pytest

from kvcore import BlockHasher, Namespace
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from kvcore.wire import WireError, encode
from routing.placement.prefix_index import ApplyOutcome, PrefixIndex

HASHER = BlockHasher(16)
SEED = Namespace("m").seed


def chain(n: int, salt: int = 0) -> list[int]:
    return HASHER.hash_tokens([salt * 1_000_003 + i for i in range(16 * n)], SEED)


def stored(
    worker: str, seq: int, blocks: list[int], parent: int | None = None, **kw: object
) -> BlockStored:
    return BlockStored(worker, kw.get("epoch", 0), seq, kw.get("tier", Tier.GPU), blocks, parent)  # type: ignore[arg-type]


class TestMatch:
    def test_reports_every_holder(self) -> None:
        """Every worker holding block 0 is reported with its own depth, not just the first."""
        index = PrefixIndex()
        blocks = chain(10)
        index.apply(stored("a", 1, blocks))
        index.apply(stored("b", 1, blocks[:4]))
        index.apply(stored("c", 1, blocks[:1]))
        index.apply(stored("d", 1, chain(10, salt=1)))
        assert index.match(blocks) == {"a": 10, "b": 4, "c": 1}
        assert index.match(blocks[:3]) == {"a": 3, "b": 3, "c": 1}
        assert index.match(chain(3, salt=2)) == {}
        assert index.match([]) == {}

    def test_continuation_without_root_does_not_match(self) -> None:
        """Blocks stored under a parent the worker lacks do not count as a leading prefix."""
        index = PrefixIndex()
        blocks = chain(6)
        index.apply(stored("a", 1, blocks[3:], parent=blocks[2]))
        assert index.match(blocks) == {}
        assert index.orphan_blocks() == 1
        index.apply(stored("a", 2, blocks[:3]))
        assert index.match(blocks) == {"a": 6}
        assert index.orphan_blocks() == 0

    def test_parent_evicted_before_children(self) -> None:
        """Removing a middle block cuts the match there even though later blocks remain."""
        index = PrefixIndex()
        blocks = chain(8)
        index.apply(stored("a", 1, blocks))
        index.apply(stored("b", 1, blocks))
        index.apply(BlockRemoved("a", 0, 2, Tier.GPU, [blocks[3]]))
        assert index.match(blocks) == {"a": 3, "b": 8}
        assert index.orphan_blocks() == 1

    def test_tiers_are_separate(self) -> None:
        """Each tier is matched on its own; match_tiers leaves out tiers with no holder."""
        index = PrefixIndex()
        blocks = chain(6)
        index.apply(stored("a", 1, blocks[:2]))
        index.apply(stored("a", 2, blocks, tier=Tier.HOST))
        assert index.match(blocks, Tier.GPU) == {"a": 2}
        assert index.match(blocks, Tier.HOST) == {"a": 6}
        assert index.match_tiers(blocks) == {Tier.GPU: {"a": 2}, Tier.HOST: {"a": 6}}


class TestSequencing:
    def test_duplicate_and_out_of_order_are_dropped(self) -> None:
        """An event with an already-applied sequence number changes nothing and is counted."""
        index = PrefixIndex()
        blocks = chain(4)
        assert index.apply(stored("a", 1, blocks)) is ApplyOutcome.APPLIED
        assert index.apply(BlockRemoved("a", 0, 2, Tier.GPU, blocks)) is ApplyOutcome.APPLIED
        assert index.apply(stored("a", 1, blocks)) is ApplyOutcome.DUPLICATE
        assert index.match(blocks) == {}
        assert index.stats.events_duplicate == 1

    def test_gap_flags_resync_until_snapshot(self) -> None:
        """A skipped sequence number is applied, counted and flags the worker for resync."""
        index = PrefixIndex()
        blocks = chain(4)
        index.apply(stored("a", 1, blocks[:1]))
        assert index.apply(stored("a", 3, blocks[1:], parent=blocks[0])) is ApplyOutcome.GAP
        assert index.needs_resync("a") and index.stats.gaps == 1
        assert index.match(blocks) == {"a": 4}
        index.load_worker_snapshot(index.worker_snapshot("a"))
        assert not index.needs_resync("a")

    def test_first_event_must_be_seq_one(self) -> None:
        """Joining a stream mid-way (first seq > 1) is a gap: state before it is unknown."""
        index = PrefixIndex()
        assert index.apply(stored("a", 5, chain(1))) is ApplyOutcome.GAP
        assert index.needs_resync("a")

    def test_new_epoch_clears_then_applies(self) -> None:
        """An engine restart (a newer epoch) clears the worker's old blocks in every tier."""
        index = PrefixIndex()
        old, new = chain(4), chain(4, salt=1)
        index.apply(stored("a", 1, old))
        index.apply(stored("a", 2, old, tier=Tier.HOST))
        assert index.apply(stored("a", 1, new, epoch=1)) is ApplyOutcome.NEW_EPOCH
        assert index.match_tiers(old) == {}
        assert index.match(new) == {"a": 4}
        assert index.apply(stored("a", 3, old, epoch=0)) is ApplyOutcome.STALE_EPOCH
        assert index.match(old) == {}

    def test_cleared_tier_only(self) -> None:
        """AllBlocksCleared empties one tier of one worker."""
        index = PrefixIndex()
        blocks = chain(3)
        index.apply(stored("a", 1, blocks))
        index.apply(stored("a", 2, blocks, tier=Tier.HOST))
        index.apply(stored("b", 1, blocks))
        index.apply(AllBlocksCleared("a", 0, 3, Tier.GPU))
        assert index.match_tiers(blocks) == {Tier.GPU: {"b": 3}, Tier.HOST: {"a": 3}}

    def test_unknown_removal_is_counted(self) -> None:
        """Removing a block the worker never stored is counted, not an error."""
        index = PrefixIndex()
        index.apply(BlockRemoved("a", 0, 1, Tier.GPU, [123]))
        assert index.stats.unknown_removals == 1


class TestWorkers:
    def test_remove_worker_frees_its_blocks_and_slot(self) -> None:
        """A removed worker's blocks leave the index; its slot is reused cleanly."""
        index = PrefixIndex()
        blocks = chain(5)
        index.apply(stored("a", 1, blocks))
        index.apply(stored("b", 1, blocks[:2]))
        assert index.remove_worker("a")
        assert not index.remove_worker("a")
        assert index.match(blocks) == {"b": 2}
        index.apply(stored("c", 1, blocks[:3]))
        assert index.match(blocks) == {"b": 2, "c": 3}
        assert sorted(index.worker_ids) == ["b", "c"]

    def test_many_workers(self) -> None:
        """Hundreds of workers each get their own depth."""
        index = PrefixIndex()
        blocks = chain(300)
        for i in range(200):
            index.apply(stored(f"w{i}", 1, blocks[: i + 1]))
        assert index.match(blocks) == {f"w{i}": i + 1 for i in range(200)}


class TestSnapshots:
    def test_round_trip(self) -> None:
        """to_bytes/from_bytes preserves blocks, positions and answers."""
        index = PrefixIndex()
        blocks = chain(6)
        index.apply(stored("a", 1, blocks))
        index.apply(BlockRemoved("a", 0, 2, Tier.GPU, [blocks[2]]))
        index.apply(stored("b", 7, blocks[:3], tier=Tier.DISK))
        restored = PrefixIndex.from_bytes(index.to_bytes())
        assert restored.match_tiers(blocks) == index.match_tiers(blocks)
        assert restored.position("a") == (0, 2)
        assert restored.needs_resync("b")
        assert restored.orphan_blocks() == index.orphan_blocks() == 1  # block 3 lost its parent

    def test_from_bytes_rejects_other_messages(self) -> None:
        """Restoring from a frame that is not an index snapshot raises WireError."""
        with pytest.raises(WireError, match="expected an index snapshot"):
            PrefixIndex.from_bytes(encode(stored("a", 1, chain(1))))
        with pytest.raises(WireError):
            PrefixIndex.from_bytes(b"\x01garbage")

    def test_memory_is_reported(self) -> None:
        """The index reports an estimate of its memory per indexed block."""
        index = PrefixIndex()
        index.apply(stored("a", 1, chain(1000)))
        per_block = index.memory_bytes() / index.num_blocks()
        assert 50 < per_block < 1000
