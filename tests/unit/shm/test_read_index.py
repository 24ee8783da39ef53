"""The read index: the seqlock that lets readers copy blocks without the owner, and how the
store keeps it in step (publish on commit, retract before eviction or removal, unpublish
before an uncommitted slot is freed) and weighs readers' uses when evicting."""

from __future__ import annotations

import numpy as np
import pytest

from shm.owner.store import BlockStore
from shm.read_index import ReadIndex, ReadIndexLayout
from tests.unit.shm.store_checks import check_store

NS = 7


def make_index(num_slots: int = 8) -> ReadIndex:
    region = np.zeros(ReadIndexLayout(num_slots).nbytes, np.uint8)
    return ReadIndex(region, num_slots, owner=True)


def copied_by(index: ReadIndex, keys: list[tuple[int, int]], hints: dict[tuple[int, int], int],
              during: object = None) -> tuple[list[bool], list[tuple[int, int]]]:
    """``index.read`` with ``hints`` given per key (readers keep them per block hash)."""
    calls: list[tuple[int, int]] = []

    def copy(i: int, slot: int) -> None:
        calls.append((i, slot))
        if callable(during):
            during(slot)

    return index.read(keys, {key[1]: slot for key, slot in hints.items()}, copy), calls


class TestSeqlock:
    def test_a_fresh_index_shows_nothing(self) -> None:
        """Every slot starts odd: a hint to any slot copies nothing."""
        index = make_index()
        hits, calls = copied_by(index, [(NS, 1)], {(NS, 1): 0})
        assert hits == [False] and calls == []
        assert all(int(v) % 2 == 1 for v in index.seq)

    def test_published_slot_is_read_and_marked(self) -> None:
        """A published slot is copied for its key only; a hit records its read time."""
        index = make_index()
        index.publish([3], [(NS, 11)])
        hits, calls = copied_by(index, [(NS, 11), (NS, 12), (NS + 1, 11)],
                                {(NS, 11): 3, (NS, 12): 3, (NS + 1, 11): 3})
        assert hits == [True, False, False]  # another hash, another namespace: no
        assert calls == [(0, 3)]
        assert index.last_read_ns(3) > 0 and index.last_read_ns(2) == 0

    def test_retract_during_the_copy_is_a_miss(self) -> None:
        """A slot retracted while being copied (evicted, reused) fails validation."""
        index = make_index()
        index.publish([1, 2], [(NS, 1), (NS, 2)])
        hits, calls = copied_by(index, [(NS, 1), (NS, 2)], {(NS, 1): 1, (NS, 2): 2},
                                during=lambda slot: slot == 2 and index.retract([2]))
        assert calls == [(0, 1), (1, 2)]
        assert hits == [True, False]

    def test_publish_by_writer_then_owner_keeps_the_seq(self) -> None:
        """A slot the writer published is left as is by the owner's publish: a reader that
        began in between still validates."""
        index = make_index()
        index.publish_slot(4, (NS, 9))  # the writer, once its bytes are in
        before = int(index.seq[4])
        assert before % 2 == 0
        index.publish([4], [(NS, 9)])  # the owner, on the commit
        assert int(index.seq[4]) == before

    def test_unpublish_only_changes_published_slots(self) -> None:
        """Freeing an uncommitted slot makes it odd whether or not its writer published it."""
        index = make_index()
        index.publish_slot(0, (NS, 1))
        odd_before = int(index.seq[1])
        index.unpublish([0, 1])
        assert int(index.seq[0]) % 2 == 1
        assert int(index.seq[1]) == odd_before

    def test_retract_all(self) -> None:
        index = make_index()
        index.publish([0, 5], [(NS, 1), (NS, 2)])
        index.retract_all()
        assert all(int(v) % 2 == 1 for v in index.seq)

    def test_region_too_small(self) -> None:
        with pytest.raises(ValueError, match="needs"):
            ReadIndex(np.zeros(16, np.uint8), 8, owner=True)


def store_with_index(num_slots: int = 4) -> tuple[BlockStore, ReadIndex]:
    index = make_index(num_slots)
    return BlockStore(num_slots, worker_id="w", read_index=index), index


def put(store: BlockStore, session: int, *hashes: int) -> list[int]:
    slots, gens = store.reserve(session, [(NS, h) for h in hashes])  # type: ignore[arg-type]
    store.commit(session, slots, gens)  # type: ignore[arg-type]
    return slots  # type: ignore[return-value]


class TestStoreKeepsTheIndex:
    def test_commit_publishes_and_eviction_retracts(self) -> None:
        """Only committed blocks are readable; the evicted one is not, before its reuse."""
        store, index = store_with_index(2)
        s = store.open_session()
        slots = put(store, s, 1, 2)
        assert [int(index.seq[x]) % 2 for x in slots] == [0, 0]
        reserved, _ = store.reserve(s, [(NS, 3)])  # type: ignore[arg-type]
        assert reserved == [slots[0]]  # block 1 evicted, its slot handed out
        assert int(index.seq[slots[0]]) % 2 == 1
        check_store(store)

    def test_remove_abort_and_closed_sessions_leave_nothing_readable(self) -> None:
        store, index = store_with_index(4)
        s = store.open_session()
        put(store, s, 1)
        store.remove([(NS, 1)])
        slots, gens = store.reserve(s, [(NS, 2), (NS, 3)])  # type: ignore[arg-type]
        store.abort(s, slots[:1], gens[:1])  # type: ignore[arg-type]
        store.close_session(s)  # slot of key 3 reserved, never published
        assert all(int(v) % 2 == 1 for v in index.seq)
        assert store.contains([(NS, 2), (NS, 3)]) == [False, False]
        check_store(store)

    def test_a_writers_publication_commits(self) -> None:
        """A writer commits by publishing its reserved slots; the store records it when
        asked (the owner asks before every request), one chain as one event, in the order
        the keys were reserved."""
        store, index = store_with_index(8)
        s = store.open_session()
        keys = [(NS, 5), (NS, 6), (NS, 7)]
        slots, _ = store.reserve(s, keys, [4, 5, 6])  # type: ignore[arg-type]
        index.publish(list(reversed(slots)), list(reversed(keys)))
        store.take_events()
        assert store.contains(keys) == [False] * 3  # not recorded yet
        assert store.commit_published() == 3
        assert store.contains(keys) == [True] * 3
        (event,) = store.take_events()
        assert event.block_hashes == [5, 6, 7] and event.parent_hash == 4  # type: ignore[attr-defined]
        assert store.commit_published() == 0
        check_store(store)

    def test_publication_under_another_key_commits_nothing(self) -> None:
        store, index = store_with_index(4)
        s = store.open_session()
        slots, gens = store.reserve(s, [(NS, 1)])
        index.publish(slots, [(NS, 2)])  # a confused writer
        assert store.commit_published() == 0
        assert store.contains([(NS, 1), (NS, 2)]) == [False, False]
        store.abort(s, slots, gens)  # type: ignore[arg-type]
        assert int(index.seq[slots[0]]) % 2 == 1
        check_store(store)

    def test_a_closed_session_keeps_what_its_writer_published(self) -> None:
        """Its writer died after publishing some slots: those are committed, the rest freed."""
        store, index = store_with_index(4)
        s, other = store.open_session(), store.open_session()
        slots, _ = store.reserve(s, [(NS, 1), (NS, 2)])
        index.publish(slots[:1], [(NS, 1)])
        store.close_session(s)
        assert store.contains([(NS, 1), (NS, 2)]) == [True, False]
        assert int(index.seq[slots[1]]) % 2 == 1  # type: ignore[index]
        got, _ = store.lease(other, [(NS, 1)])
        assert got == slots[:1]
        check_store(store)

    def test_eviction_weighs_readers_uses(self) -> None:
        """A block readers used since its commit outlives an older-used one."""
        store, index = store_with_index(3)
        s = store.open_session()
        first, second, _ = (put(store, s, h)[0] for h in (1, 2, 3))
        copied_by(index, [(NS, 1)], {(NS, 1): first})  # block 1 read: now the most recent
        assert store.reserve(s, [(NS, 4)])[0] == [second]  # block 2 goes, not block 1
        assert store.contains([(NS, 1), (NS, 2)]) == [True, False]
        check_store(store)

    def test_a_leased_block_ranks_by_its_place_in_the_lru(self) -> None:
        """A lease moves a block behind newer commits without stamping it: when readers'
        uses are weighed, it still ranks at least as recent as the blocks in front of it."""
        store, index = store_with_index(4)
        s = store.open_session()
        first, _, third = (put(store, s, h)[0] for h in (1, 2, 3))
        slots, gens = store.lease(s, [(NS, 1)])
        store.release(s, slots, gens)  # type: ignore[arg-type]  # LRU now: 2, 3, 1
        copied_by(index, [(NS, 3)], {(NS, 3): third})  # 3 read after everything
        put(store, s, 4)  # fills the last free slot
        assert store.reserve(s, [(NS, 5)])[0] != [first]  # not block 1: block 2 is older
        assert store.contains([(NS, 1), (NS, 2)]) == [True, False]
        check_store(store)
