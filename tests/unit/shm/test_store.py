"""The block store core: visibility, leases, LRU eviction, sessions and host-tier events."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from shm.errors import StaleDescriptorError, StoreFullError
from shm.owner.store import BlockStore
from shm.read_index import STANDBY_TAKEN, ReadIndex, ReadIndexLayout
from tests.unit.shm.store_checks import check_store

NS = 42


def keys(*hashes: int) -> list[tuple[int, int]]:
    return [(NS, h) for h in hashes]


def put(store: BlockStore, session: int, *hashes: int) -> None:
    slots, gens = store.reserve(session, keys(*hashes))  # type: ignore[arg-type]
    got = [(s, g) for s, g in zip(slots, gens, strict=True) if s is not None]
    store.commit(session, [s for s, _ in got], [g for _, g in got])  # type: ignore[arg-type]


@pytest.fixture
def store() -> BlockStore:
    return BlockStore(4, worker_id="w0")


class TestPuts:
    def test_reserved_blocks_are_invisible_until_commit(self, store: BlockStore) -> None:
        """A reserved block is neither contained nor leasable; after commit it is both."""
        s = store.open_session()
        slots, gens = store.reserve(s, keys(1))
        assert store.contains(keys(1)) == [False]
        assert store.lease(s, keys(1)) == ([None], [None])
        store.commit(s, slots, gens)  # type: ignore[arg-type]
        assert store.contains(keys(1)) == [True]
        check_store(store)

    def test_held_and_in_flight_keys_get_no_slot(self, store: BlockStore) -> None:
        """A key already held, being written, or repeated in the batch gets no second slot."""
        a, b = store.open_session(), store.open_session()
        put(store, a, 1)
        store.reserve(a, keys(2))
        slots, _ = store.reserve(b, keys(1, 2, 3, 3))
        assert slots[:2] == [None, None] and slots[2] is not None and slots[3] is None
        check_store(store)

    def test_namespace_is_part_of_the_key(self, store: BlockStore) -> None:
        """The same block hash under two namespaces is two blocks."""
        s = store.open_session()
        put(store, s, 5)
        assert store.contains([(NS, 5), (NS + 1, 5)]) == [True, False]

    def test_commit_rejects_foreign_or_stale_descriptors(self, store: BlockStore) -> None:
        """Only the reserving session may commit, with the current generation."""
        a, b = store.open_session(), store.open_session()
        slots, gens = store.reserve(a, keys(1))
        with pytest.raises(StaleDescriptorError, match="not reserved by this client"):
            store.commit(b, slots, gens)  # type: ignore[arg-type]
        with pytest.raises(StaleDescriptorError):
            store.commit(a, slots, [gens[0] + 1])  # type: ignore[arg-type, operator]
        store.commit(a, slots, gens)  # type: ignore[arg-type]
        check_store(store)

    def test_abort_frees_the_reservation(self, store: BlockStore) -> None:
        """An aborted put leaves nothing and returns its slot."""
        s = store.open_session()
        slots, gens = store.reserve(s, keys(1, 2))
        store.abort(s, slots, gens)  # type: ignore[arg-type]
        assert store.stats().num_free_slots == 4 and store.contains(keys(1)) == [False]
        check_store(store)


class TestEviction:
    def test_lru_order_is_exact(self, store: BlockStore) -> None:
        """The least recently used unleased block goes first; a read makes a block recent."""
        s = store.open_session()
        put(store, s, 1, 2, 3, 4)
        slots, gens = store.lease(s, keys(1))
        store.release(s, slots, gens)  # type: ignore[arg-type]
        put(store, s, 5, 6)
        assert store.contains(keys(1, 2, 3, 4, 5, 6)) == [True, False, False, True, True, True]
        check_store(store)

    def test_leased_blocks_are_never_evicted(self, store: BlockStore) -> None:
        """Eviction skips leased blocks; with everything leased a put raises StoreFullError."""
        s = store.open_session()
        put(store, s, 1, 2, 3, 4)
        store.lease(s, keys(1, 2, 3))
        put(store, s, 5)
        assert store.contains(keys(1, 2, 3, 4, 5)) == [True, True, True, False, True]
        store.lease(s, keys(5))
        with pytest.raises(StoreFullError, match="1 slots needed, 0 free and 0 evictable"):
            store.reserve(s, keys(6))
        check_store(store)

    def test_store_full_changes_nothing(self, store: BlockStore) -> None:
        """A batch that cannot fit is refused whole: no eviction, no reservation."""
        s = store.open_session()
        put(store, s, 1, 2)
        store.lease(s, keys(1))
        with pytest.raises(StoreFullError):
            store.reserve(s, keys(10, 11, 12, 13))
        assert store.contains(keys(1, 2)) == [True, True]
        assert store.stats().num_reserved == 0
        check_store(store)


class TestLeasesAndSessions:
    def test_release_checks_holder_and_count(self, store: BlockStore) -> None:
        """A session releases only leases it holds, no more times than it took them."""
        a, b = store.open_session(), store.open_session()
        put(store, a, 1)
        slots, gens = store.lease(a, keys(1))
        with pytest.raises(StaleDescriptorError):
            store.release(b, slots, gens)  # type: ignore[arg-type]
        with pytest.raises(StaleDescriptorError):
            store.release(a, slots * 2, gens * 2)  # type: ignore[arg-type]
        store.release(a, slots, gens)  # type: ignore[arg-type]
        check_store(store)

    def test_closing_a_session_frees_everything_it_held(self, store: BlockStore) -> None:
        """A dead client's reservations vanish and its leases are released."""
        a, b = store.open_session(), store.open_session()
        put(store, a, 1, 2)
        store.lease(b, keys(1, 2))
        store.lease(b, keys(1))
        store.reserve(b, keys(3, 4))
        store.close_session(b)
        stats = store.stats()
        assert (stats.num_leased_blocks, stats.num_reserved, stats.num_free_slots) == (0, 0, 2)
        assert store.contains(keys(3, 4)) == [False, False]
        put(store, a, 5, 6, 7, 8)  # the released blocks are evictable again
        check_store(store)

    def test_removed_leased_block_keeps_its_slot_until_released(self, store: BlockStore) -> None:
        """remove() hides a leased block at once but frees its slot only on the last release."""
        s = store.open_session()
        put(store, s, 1)
        slots, gens = store.lease(s, keys(1))
        assert store.remove(keys(1, 9)) == [True, False]
        assert store.contains(keys(1)) == [False]
        assert store.stats().num_free_slots == 3
        store.release(s, slots, gens)  # type: ignore[arg-type]
        assert store.stats().num_free_slots == 4
        check_store(store)

    def test_closed_session_is_refused(self, store: BlockStore) -> None:
        """A request on a closed session raises instead of touching the store."""
        s = store.open_session()
        store.close_session(s)
        with pytest.raises(StaleDescriptorError, match="closed"):
            store.reserve(s, keys(1))


class TestEvents:
    def test_stored_chain_removed_and_cleared(self) -> None:
        """Commits, evictions and clears become host-tier events with seq 1, 2, 3, ..."""
        store = BlockStore(2, worker_id="w0")
        s = store.open_session()
        slots, gens = store.reserve(s, keys(10, 11), [None, 10], [[1, 2], [3, 4]])
        store.commit(s, slots, gens)  # type: ignore[arg-type]
        put(store, s, 12)
        store.clear()
        assert store.take_events() == [
            BlockStored("w0", 0, 0, Tier.HOST, [10, 11], None, [1, 2, 3, 4]),
            BlockRemoved("w0", 0, 0, Tier.HOST, [10]),
            BlockStored("w0", 0, 0, Tier.HOST, [12], None, None),
            AllBlocksCleared("w0", 0, 0, Tier.HOST),
        ]
        assert store.take_events() == []

    def test_unchained_blocks_get_one_event_each(self, store: BlockStore) -> None:
        """Blocks whose parents do not chain are reported as separate stored events."""
        s = store.open_session()
        slots, gens = store.reserve(s, keys(1, 2, 3), [None, 99, 2])
        store.commit(s, slots, gens)  # type: ignore[arg-type]
        events = store.take_events()
        assert [(e.block_hashes, e.parent_hash) for e in events] == [  # type: ignore[union-attr]
            ([1], None), ([2, 3], 99)]

    def test_removal_event(self, store: BlockStore) -> None:
        """remove() reports only the keys that were held."""
        s = store.open_session()
        put(store, s, 1)
        store.take_events()
        store.remove(keys(1, 2))
        assert store.take_events() == [BlockRemoved("w0", 0, 0, Tier.HOST, [1])]


class TestWriteAheadGrants:
    def test_grant_is_capped_store_wide_and_evicts_like_a_reservation(self) -> None:
        """Grants top a session up to what it asks, within the store-wide cap; a full store
        evicts its least recent block for one, and a grant never raises StoreFullError."""
        store = BlockStore(4, worker_id="w", max_granted=2)
        a, b = store.open_session(), store.open_session()
        assert len(store.grant(a, 1)[0]) == 1
        assert store.grant(a, 1) == ([], [])  # already holds one
        assert len(store.grant(b, 5)[0]) == 1  # the cap: two in all
        assert store.stats().num_granted == 2
        put(store, a, 1, 2)  # the two slots left
        store.close_session(b)  # gives its grant back
        assert store.stats().num_granted == 1
        put(store, a, 3)
        slots, _ = store.grant(a, 2)  # the store is full: evicts block 1, the oldest
        assert len(slots) == 1 and store.contains(keys(1, 2, 3)) == [False, True, True]
        lease_all = store.open_session()
        store.lease(lease_all, keys(2, 3))
        assert store.grant(a, 3) == ([], [])  # nothing evictable: no grant, no error
        check_store(store)

    def test_claim_reserves_granted_slots_and_skips_held_keys(self) -> None:
        """A claim reserves granted slots as given (same generations); a key held or in
        flight gets none and its slot stays granted; commit then publishes as usual."""
        store = BlockStore(8, worker_id="w", max_granted=4)
        a, b = store.open_session(), store.open_session()
        put(store, b, 1)
        slots, gens = store.grant(a, 3)
        got, got_gens = store.claim(a, keys(1, 2, 2), slots, gens, [None, 1, 1])
        assert got == [None, slots[1], None] and got_gens == [None, gens[1], None]
        assert store.stats().num_granted == 2 and store.stats().num_reserved == 1
        assert store.contains(keys(2)) == [False]  # not before commit
        store.commit(a, [slots[1]], [gens[1]])
        assert store.contains(keys(2)) == [True]
        stored = [e for e in store.take_events() if isinstance(e, BlockStored)]
        assert stored[-1].block_hashes == [2] and stored[-1].parent_hash == 1
        check_store(store)

    def test_claim_rejects_what_was_not_granted(self) -> None:
        """Slots not granted to the session, stale generations or a slot named twice are
        refused and change nothing; a closed session's grants are freed."""
        store = BlockStore(8, worker_id="w", max_granted=4)
        a, b = store.open_session(), store.open_session()
        slots, gens = store.grant(a, 2)
        other, other_gens = store.grant(b, 1)
        bad = [
            (slots[:1], [gens[0] + 1], "not granted to this client"),  # stale generation
            (other, other_gens, "not granted to this client"),  # another session's
            ([slots[0], slots[0]], [gens[0], gens[0]], "same slot twice"),
        ]
        for bad_slots, bad_gens, message in bad:
            with pytest.raises(StaleDescriptorError, match=message):
                store.claim(a, keys(*range(len(bad_slots))), bad_slots, bad_gens)
        assert store.stats().num_granted == 3 and store.stats().num_reserved == 0
        store.close_session(a)
        assert store.stats().num_granted == 1 and store.stats().num_free_slots == 7
        with pytest.raises(ValueError, match="keys for"):
            store.claim(b, keys(1, 2), other, other_gens)
        check_store(store)


class StoreMachine(RuleBasedStateMachine):
    """Random puts, leases, releases, removals and disconnects keep the books consistent."""

    def __init__(self) -> None:
        super().__init__()
        region = np.zeros(ReadIndexLayout(6).nbytes, np.uint8)
        self.index = ReadIndex(region, 6, owner=True)  # kept in step: see check_store
        self.store = BlockStore(6, worker_id="w", read_index=self.index,
                                max_granted=3)
        self.sessions = [self.store.open_session() for _ in range(3)]
        for cell, session in enumerate(self.sessions):  # cell: its standby word
            self.store.attach_cell(session, cell)
        self.leases: dict[int, list[tuple[int, int]]] = {s: [] for s in self.sessions}
        self.grants: dict[int, list[tuple[int, int]]] = {s: [] for s in self.sessions}
        # Per session, as its client sees it: the standby grant it took (epoch, slots, how
        # many of them it retracted, about to overwrite them); then, once it recorded its
        # overwrite (DONE) and until the owner picks it up, the keys it published per slot.
        self.taking: dict[int, tuple[int, list[int], int]] = {}
        self.done: dict[int, dict[int, tuple[int, int]]] = {}
        # Per session, the slots of its taken grant it did not retract: the owner has dropped
        # them from its books (the writer won them), but their bytes are still the blocks the
        # read index names there, until the owner picks the grant up.
        self.untouched: dict[int, set[int]] = {}

    @rule(who=st.integers(0, 2), hashes=st.lists(st.integers(0, 12), max_size=4),
          commit=st.booleans(), writer_publishes=st.booleans(), standby=st.booleans())
    def put(self, who: int, hashes: list[int], commit: bool, writer_publishes: bool,
            standby: bool) -> None:
        session = self.sessions[who]
        try:  # standby: it wants a standby grant if this fills the store
            slots, gens = self.store.reserve(session, keys(*hashes), standby=standby)
        except StoreFullError:
            return
        got = [(s, g) for s, g in zip(slots, gens, strict=True) if s is not None]
        assert len({s for s, _ in got}) == len(got)
        if writer_publishes:  # as a client does once its bytes are in: that commits too
            for slot, key in zip(slots, keys(*hashes), strict=True):
                if slot is not None:
                    self.index.publish_slot(slot, key)
        if commit:
            self.store.commit(session, [s for s, _ in got], [g for _, g in got])

    @rule(who=st.sets(st.integers(0, 2)), everyone=st.booleans())
    def record_published(self, who: set[int], everyone: bool) -> None:
        """What the owner does before every request (for the sessions whose publication
        count moved) and on its poll (for all): writers' publications commit."""
        sessions = None if everyone else [self.sessions[w] for w in who]
        self.store.settle()  # the books the last reserve left for after its reply
        mine = set().union(*(self.store._sessions[s].reserved for s in (
            self.sessions if sessions is None else sessions)))
        published = {s for s in self.index.published(self.store._reserved.items()) if s in mine}
        done = {s: self.done.pop(s) for s in list(self.done)
                if sessions is None or s in sessions}  # picked up too
        for session in done:
            self.untouched.pop(session, None)
        assert self.store.commit_published(sessions) >= len(published)
        self.store.offer_due()  # after the reply: the next standby grants
        assert published <= set(self.store._blocks.values())
        for written in done.values():
            assert self._kept_or_in_flight(list(written.values()))

    @rule(who=st.integers(0, 2), want=st.integers(1, 3))
    def grant(self, who: int, want: int) -> None:
        session = self.sessions[who]
        slots, gens = self.store.grant(session, want)
        assert len(self.grants[session]) + len(slots) <= max(want, len(self.grants[session]))
        self.grants[session] += zip(slots, gens, strict=True)

    @rule(who=st.integers(0, 2), hashes=st.lists(st.integers(0, 12), max_size=3),
          commit=st.booleans())
    def claim(self, who: int, hashes: list[int], commit: bool) -> None:
        """A writer fills granted slots, then claims them (bytes written before the owner
        answers): what it claims for held keys stays granted, the rest commits or aborts."""
        session = self.sessions[who]
        held = self.grants[session]
        hashes = hashes[: len(held)]  # as many keys as the session holds granted slots
        taken, self.grants[session] = held[: len(hashes)], held[len(hashes) :]
        slots, gens = self.store.claim(session, keys(*hashes), [s for s, _ in taken],
                                       [g for _, g in taken])
        self.grants[session] += [t for t, s in zip(taken, slots, strict=True) if s is None]
        got = [(s, g) for s, g in zip(slots, gens, strict=True) if s is not None]
        assert got == [t for t, s in zip(taken, slots, strict=True) if s is not None]
        if commit:
            for slot, key in zip(slots, keys(*hashes), strict=True):
                if slot is not None:
                    self.index.publish_slot(slot, key)
            self.store.commit(session, [s for s, _ in got], [g for _, g in got])
        elif got:
            self.store.abort(session, [s for s, _ in got], [g for _, g in got])

    @rule(who=st.integers(0, 2), want=st.integers(0, 4))
    def offer_standby(self, who: int, want: int) -> None:
        """The owner offers a standby grant (after a pickup, with the largest put the
        session reserved into a full store), the one before taken back."""
        session = self.sessions[who]
        slots, epoch = self.store.offer_standby(session, want)
        assert (epoch == 0) == (not slots) and len(slots) <= want
        assert all(self.store._blocks.get(self.store._key[s]) == s for s in slots)  # type: ignore[arg-type]
        if slots:
            assert self.index.grant_slots(who) == slots

    @rule(who=st.integers(0, 2), count=st.integers(0, 4))
    def take_standby(self, who: int, count: int) -> None:
        """A writer takes its grant as a put does: swap, then retract what it overwrites."""
        session = self.sessions[who]
        if session in self.taking or session in self.done:
            return  # mid-put, or its last one not picked up yet (its word is DONE)
        epoch, _ = self.index.offered(who, 0)
        if not epoch or not self.index.swap_standby(who, epoch, STANDBY_TAKEN):
            return  # none offered, or taken back meanwhile
        slots = self.index.grant_slots(who)
        self.taking[session] = (epoch, slots, min(count, len(slots)))
        self.index.unpublish(slots[: self.taking[session][2]])
        self.untouched[session] = set(slots[self.taking[session][2]:])

    @precondition(lambda self: bool(self.taking))
    @rule(data=st.data(), hashes=st.lists(st.integers(0, 12), max_size=4),
          pick_up=st.booleans())
    def overwrite(self, data: st.DataObject, hashes: list[int], pick_up: bool) -> None:
        """It publishes its keys in the slots it retracted (those left over: spoiled),
        records them and marks its word DONE; the owner picks that up now, or later
        (before a request, on its poll, or at the writer's end): a key held or in flight
        loses its copy, the rest commit."""
        session = data.draw(st.sampled_from(sorted(self.taking)))
        epoch, slots, count = self.taking.pop(session)
        cell = self.sessions.index(session)
        written = slots[: min(count, len(hashes))]
        wanted = keys(*hashes[: len(written)])
        for slot, key in zip(written, wanted, strict=True):
            self.index.publish_slot(slot, key)
        self.index.record_overwrite(cell, written, [h or None for _, h in wanted])
        self.index.done_standby(cell, epoch)
        self.done[session] = dict(zip(written, wanted, strict=True))
        if pick_up:
            self.store.commit_published([session])
            self.store.offer_due()
            del self.done[session]
            self.untouched.pop(session, None)
            assert self._kept_or_in_flight(wanted)
            for slot, key in zip(written, wanted, strict=True):
                if self.store._blocks.get(key) == slot and key[1]:
                    assert self.store._parent[slot] == key[1]

    @rule(hashes=st.lists(st.integers(0, 12), max_size=4),
          hint_slots=st.lists(st.integers(0, 5), min_size=4, max_size=4))
    def read_optimistically(self, hashes: list[int], hint_slots: list[int]) -> None:
        """A reader with arbitrary (often stale) hints copies only a block whose bytes are
        complete: committed, or reserved and published by its writer (about to commit)."""
        wanted = keys(*hashes)
        hints = {key[1]: slot for key, slot in zip(wanted, hint_slots, strict=False)}
        hits = self.index.read(wanted, hints, lambda i, slot: None)
        blocks, reserved = self.store._blocks, self.store._reserved  # the store's truth
        recorded = {(slot, key) for written in self.done.values() for slot, key in
                    written.items()}  # published over a standby grant, not picked up yet
        untouched = set().union(*self.untouched.values())
        for key, hit in zip(wanted, hits, strict=True):
            slot = hints[key[1]]
            assert not hit or slot in (blocks.get(key), reserved.get(key)) or (
                slot, key) in recorded or slot in untouched
        overwriting = {slot for _, slots, count in self.taking.values()  # never a slot a
                       for slot in slots[:count]}  # writer retracted
        assert not any(hit and hints[key[1]] in overwriting
                       for key, hit in zip(wanted, hits, strict=True))

    @rule(who=st.integers(0, 2), hashes=st.lists(st.integers(0, 12), max_size=4))
    def lease(self, who: int, hashes: list[int]) -> None:
        session = self.sessions[who]
        slots, gens = self.store.lease(session, keys(*hashes))
        self.leases[session] += [(s, g) for s, g in zip(slots, gens, strict=True)
                                 if s is not None]  # type: ignore[misc]

    @precondition(lambda self: any(self.leases.values()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        session = data.draw(st.sampled_from([s for s, held in self.leases.items() if held]))
        held = self.leases[session]
        count = data.draw(st.integers(1, len(held)))
        chosen, self.leases[session] = held[:count], held[count:]
        self.store.release(session, [s for s, _ in chosen], [g for _, g in chosen])

    @rule(hashes=st.lists(st.integers(0, 12), max_size=3))
    def remove(self, hashes: list[int]) -> None:
        self.store.remove(keys(*hashes))

    @rule(who=st.integers(0, 2))
    def reconnect(self, who: int) -> None:
        old = self.sessions[who]
        self.store.close_session(old)
        del self.leases[old]
        del self.grants[old]
        self.taking.pop(old, None)  # died mid-put: what it took is freed
        self.untouched.pop(old, None)
        written = self.done.pop(old, {})  # died after its put: picked up at its end
        assert self._kept_or_in_flight(list(written.values()))
        self.sessions[who] = self.store.open_session()
        self.store.attach_cell(self.sessions[who], who)
        self.leases[self.sessions[who]] = []
        self.grants[self.sessions[who]] = []

    def _kept_or_in_flight(self, picked_up: list[tuple[int, int]]) -> bool:
        """Keys a standby overwrite published, once picked up: each is held now, or another
        writer's put of it is in flight (its copy was dropped; that put holds the key)."""
        held = self.store.contains(picked_up)
        return all(h or key in self.store._reserved for h, key in zip(held, picked_up,
                                                                       strict=True))

    @invariant()
    def books_balance(self) -> None:
        check_store(self.store)

    @invariant()
    def events_are_unstamped_host_events(self) -> None:
        for event in self.store.take_events():  # the sidecar's relay numbers them
            assert (event.epoch, event.seq) == (0, 0) and event.tier is Tier.HOST
            assert event.worker_id == "w"


TestStoreProperties = StoreMachine.TestCase
