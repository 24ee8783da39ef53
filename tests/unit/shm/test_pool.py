"""The slot pool: distinct slots, conservation, generations (unit and property tests)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shm.owner.pool import SlotPool


class TestSlotPool:
    def test_allocates_distinct_slots_lifo(self) -> None:
        """Slots come out distinct, and the slot freed last is handed out first."""
        pool = SlotPool(4)
        first = pool.allocate(3)
        assert len(set(first)) == 3 and pool.num_free_slots == 1
        pool.free([first[1]])
        assert pool.allocate(1) == [first[1]]

    def test_generation_bumps_on_each_allocation(self) -> None:
        """A slot's generation grows every time it is handed out again."""
        pool = SlotPool(1)
        (slot,) = pool.allocate(1)
        assert pool.generations[slot] == 1
        pool.free([slot])
        pool.allocate(1)
        assert pool.generations[slot] == 2

    def test_mirror_follows_generations(self) -> None:
        """The shared-memory mirror holds the same generations as the pool."""
        mirror = np.full(3, 99, dtype=np.uint64)
        pool = SlotPool(3, mirror)
        assert mirror.tolist() == [0, 0, 0]
        slots = pool.allocate(2)
        assert [int(mirror[s]) for s in slots] == [1, 1]

    def test_over_allocation_changes_nothing(self) -> None:
        """Asking for more slots than are free raises and leaves the pool as it was."""
        pool = SlotPool(2)
        with pytest.raises(ValueError, match="3 slots asked, 2 free"):
            pool.allocate(3)
        assert pool.num_free_slots == 2

    def test_double_free_is_refused_atomically(self) -> None:
        """Freeing a free slot, or one slot twice, raises and frees nothing."""
        pool = SlotPool(3)
        a, b = pool.allocate(2)
        with pytest.raises(ValueError, match="not allocated"):
            pool.free([a, 2])
        with pytest.raises(ValueError, match="twice"):
            pool.free([a, a])
        assert pool.num_free_slots == 1
        pool.free([a, b])
        assert pool.num_free_slots == 3

    def test_rejects_empty_pool_and_bad_mirror(self) -> None:
        """A pool needs a slot, and a mirror must have one entry per slot."""
        with pytest.raises(ValueError, match="at least one slot"):
            SlotPool(0)
        with pytest.raises(ValueError, match="mirror"):
            SlotPool(2, np.zeros(3, np.uint64))


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against a model: a set of handed-out slots."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = SlotPool(16)
        self.held: set[int] = set()
        self.last_generation = [0] * 16

    @rule(count=st.integers(0, 6))
    def allocate(self, count: int) -> None:
        if count > self.pool.num_free_slots:
            with pytest.raises(ValueError):
                self.pool.allocate(count)
            return
        got = self.pool.allocate(count)
        assert len(set(got)) == len(got), "a slot handed out twice in one call"
        assert not set(got) & self.held, "a slot handed out while still held"
        for slot in got:
            assert self.pool.generations[slot] == self.last_generation[slot] + 1
            self.last_generation[slot] += 1
        self.held |= set(got)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        chosen = data.draw(st.sets(st.sampled_from(sorted(self.held)), min_size=1))
        self.pool.free(sorted(chosen))
        self.held -= chosen

    @rule(slot=st.integers(0, 15))
    def free_unheld_is_refused(self, slot: int) -> None:
        if slot in self.held:
            return
        with pytest.raises(ValueError):
            self.pool.free([slot])

    @invariant()
    def count_is_conserved(self) -> None:
        assert self.pool.num_free_slots + len(self.held) == self.pool.num_slots
        assert all(not self.pool.is_free(s) for s in self.held)


TestPoolProperties = PoolMachine.TestCase
