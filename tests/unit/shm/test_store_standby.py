"""The block store's standby grants (``shm.owner.store.standby``): offered once the store is
full, overwritten by their writer with no reply waited for, taken back when others need
their blocks, and dropped from the books when their writer has taken them first."""

from __future__ import annotations

import numpy as np
import pytest

from kvcore.events import BlockRemoved, BlockStored
from shm.errors import StaleDescriptorError, StoreFullError
from shm.owner._client_cells import ClientCells
from shm.owner.store import BlockStore
from shm.read_index import STANDBY_TAKEN, ReadIndex, ReadIndexLayout
from tests.unit.shm.store_checks import check_store

NS = 7


def keys(*hashes: int) -> list[tuple[int, int]]:
    return [(NS, h) for h in hashes]


class Fixture:
    def __init__(self, num_slots: int = 4) -> None:
        self.index = ReadIndex(np.zeros(ReadIndexLayout(num_slots).nbytes, np.uint8),
                               num_slots, owner=True)
        self.store = BlockStore(num_slots, worker_id="w", read_index=self.index)

    def open(self) -> int:
        """A session, with read-index cell ``session - 1`` (its standby word)."""
        session = self.store.open_session()
        self.store.attach_cell(session, session - 1)
        return session

    def put(self, session: int, *hashes: int) -> None:
        slots, gens = self.store.reserve(session, keys(*hashes))  # type: ignore[arg-type]
        got = [(s, g) for s, g in zip(slots, gens, strict=True) if s is not None]
        self.store.commit(session, [s for s, _ in got], [g for _, g in got])  # type: ignore[arg-type]

    def overwrite(self, session: int, cell: int, epoch: int, slots: list[int],
                  *hashes: int) -> tuple[list[int | None], list[int | None]]:
        """What a writer's put does: take, retract, write, publish, then ``overwrite``."""
        assert self.index.swap_standby(cell, epoch, STANDBY_TAKEN)
        used = slots[: len(hashes)]
        self.index.unpublish(used)
        for slot, key in zip(used, keys(*hashes), strict=True):
            self.index.publish_slot(slot, key)
        return self.store.overwrite(session, epoch, keys(*hashes), used)  # type: ignore[arg-type]


def test_offered_only_when_full_then_overwritten_with_its_events() -> None:
    f = Fixture()
    a = f.open()
    f.put(a, 1, 2)
    assert f.store.offer_standby(a, 2) == ([], 0)  # two free slots: no need
    f.put(a, 3, 4)
    f.store.take_events()
    slots, epoch = f.store.offer_standby(a, 2)
    assert slots == [f.store._blocks[k] for k in keys(1, 2)] and epoch > 0
    assert f.store.contains(keys(1, 2)) == [True, True]  # on standby, still held
    check_store(f.store)
    got, _ = f.overwrite(a, 0, epoch, slots, 5, 6)
    assert got == slots and f.store.contains(keys(1, 2, 5, 6)) == [False, False, True, True]
    removed, *stored = f.store.take_events()
    assert isinstance(removed, BlockRemoved) and sorted(removed.block_hashes) == [1, 2]
    assert [h for e in stored if isinstance(e, BlockStored) for h in e.block_hashes] == [5, 6]
    assert f.store.stats().num_overwrites == 2
    check_store(f.store)


def test_idle_grant_is_taken_back_for_a_reserve_and_a_lease() -> None:
    f = Fixture()
    a, b = f.open(), f.open()
    f.put(a, 1, 2, 3, 4)
    slots, epoch = f.store.offer_standby(a, 2)
    f.put(b, 5, 6)  # evicts 3 and 4, passing over the standby blocks
    assert f.store.contains(keys(1, 2, 3, 4)) == [True, True, False, False]
    assert f.store.stats().num_standby == 2
    f.put(b, 7, 8, 9)  # no other room: the grant is taken back, 1 and 2 evicted
    assert f.store.stats().num_standby == 0 and f.store.contains(keys(1, 2)) == [False] * 2
    assert not f.index.swap_standby(0, epoch, STANDBY_TAKEN)  # the writer learns it so
    slots, epoch = f.store.offer_standby(a, 1)
    assert f.store.lease(b, keys(6))[0] == slots  # a lease takes it back too
    assert f.store.stats().num_standby == 0
    check_store(f.store)


def test_a_taken_grant_is_in_flight_until_overwritten_or_its_writer_goes() -> None:
    f = Fixture()
    a, b = f.open(), f.open()
    f.put(a, 1, 2, 3, 4)
    slots, epoch = f.store.offer_standby(a, 2)
    assert f.index.swap_standby(0, epoch, STANDBY_TAKEN)  # mid-put
    with pytest.raises(StoreFullError):
        f.put(b, 5, 6, 7)  # 1 and 2 are being overwritten: only 3 and 4 can go
    assert f.store.contains(keys(1, 2)) == [False, False]  # dropped, never torn
    assert f.store.lease(b, keys(1))[0] == [None]
    check_store(f.store)
    f.index.unpublish(slots[:1])
    f.index.publish_slot(slots[0], keys(9)[0])
    got, _ = f.store.overwrite(a, epoch, keys(9), slots[:1])  # the other one: untouched
    assert got == slots[:1] and f.store.contains(keys(9)) == [True]
    assert f.store.stats().num_free_slots == 1
    check_store(f.store)
    slots, epoch = f.store.offer_standby(a, 2)
    assert f.index.swap_standby(0, epoch, STANDBY_TAKEN)
    f.store.close_session(a)  # died mid-put: what it took is freed
    assert f.store.stats().num_free_slots == 1 + len(slots)
    check_store(f.store)


def test_overwrite_refuses_what_is_not_its_taken_grant() -> None:
    f = Fixture()
    a, b = f.open(), f.open()
    f.put(a, 1, 2, 3, 4)
    slots, epoch = f.store.offer_standby(a, 2)
    with pytest.raises(StaleDescriptorError, match="not taken"):
        f.store.overwrite(a, epoch, keys(5), slots[:1])  # never swapped to TAKEN
    assert f.index.swap_standby(0, epoch, STANDBY_TAKEN)
    with pytest.raises(StaleDescriptorError, match="not taken"):
        f.store.overwrite(b, epoch, keys(5), slots[:1])  # another session's grant
    other = next(s for s in range(4) if s not in slots)
    with pytest.raises(StaleDescriptorError, match="outside"):
        f.store.overwrite(a, epoch, keys(5), [other])
    check_store(f.store)


def test_a_key_held_elsewhere_keeps_one_copy() -> None:
    f = Fixture()
    a = f.open()
    f.put(a, 1, 2, 3, 4)
    slots, epoch = f.store.offer_standby(a, 2)
    got, _ = f.overwrite(a, 0, epoch, slots, 4, 5)  # 4 is held: that copy is dropped
    assert got == [None, slots[1]] and f.store.contains(keys(4, 5)) == [True, True]
    assert f.store.stats().num_free_slots == 1
    check_store(f.store)


def _silent_put(index: ReadIndex, cell: int, count: int, *hashes: int) -> list[int]:
    """What a client's put over its grant does, sending nothing: take, retract, write,
    then record, publish, mark DONE and count the publication (the ``count``-th)."""
    epoch, _ = index.offered(cell, len(hashes))
    assert epoch and index.swap_standby(cell, epoch, STANDBY_TAKEN)
    slots = index.grant_slots(cell)[: len(hashes)]
    index.unpublish(slots)
    index.record_overwrite(cell, slots, [h - 1 for h in hashes])
    index.publish(slots, keys(*hashes))
    index.done_standby(cell, epoch)
    index.count_publication(cell, count)
    return slots


def test_a_silent_put_is_picked_up_before_any_request_and_at_its_writers_end() -> None:
    """No message: the owner learns of an overwrite from the writer's publication count,
    which it reads before every request (``ClientCells.record_publications``), then
    offers the next grant; a writer gone before that is picked up at its session's end."""
    f = Fixture()
    cells = ClientCells(f.index, f.store)
    a, b = f.store.open_session(), f.store.open_session()
    cells.open(a)
    cells.open(b)
    cell = cells.cell_of(a)
    slots, _ = f.store.reserve(a, keys(1, 2, 3, 4), standby=True)  # fills it: a wants 4
    for slot, key in zip(slots, keys(1, 2, 3, 4), strict=True):
        f.index.publish_slot(slot, key)  # its commit, by publication
    f.index.count_publication(cell, 1)
    assert f.index.offered(cell, 4) == (0, 0)
    assert cells.record_publications() == 4  # before b's request: committed
    f.store.offer_due()  # after the reply: offered
    epoch, size = f.index.offered(cell, 4)
    assert epoch and size == 4
    written = _silent_put(f.index, cell, 2, 5, 6)
    assert f.store.contains(keys(5, 6)) == [False, False]  # not picked up yet
    assert cells.record_publications() == 2  # before b's next request
    f.store.offer_due()
    assert f.store.contains(keys(1, 2, 3, 4, 5, 6)) == [False, False, True, True, True, True]
    assert [f.store._blocks[k] for k in keys(5, 6)] == written
    assert [f.store._parent[s] for s in written] == [4, 5]
    assert f.index.offered(cell, 4)[0] > epoch  # the next grant: 3, 4, 5, 6
    assert f.store.stats().num_overwrites == 2
    check_store(f.store)
    _silent_put(f.index, cell, 3, 7, 8, 9, 10)
    cells.close(a)
    f.store.close_session(a)  # gone before any pickup: its put stands
    assert f.store.contains(keys(7, 8, 9, 10)) == [True] * 4
    assert f.store.stats().num_standby == 0
    check_store(f.store)


def test_no_grant_for_a_writer_holding_write_ahead_grants() -> None:
    """A writer with slots granted ahead claims those: a standby grant would sit idle, and
    while any is out eviction must look past it."""
    f = Fixture()
    f.store = BlockStore(4, worker_id="w", read_index=f.index, max_granted=1)
    a = f.open()
    f.put(a, 1, 2, 3)
    assert len(f.store.grant(a, 1)[0]) == 1  # the fourth slot, granted ahead
    assert f.store.offer_standby(a, 2) == ([], 0)
    check_store(f.store)
