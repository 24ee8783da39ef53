"""The slot pool: which slots of a segment are free, and each slot's generation.

Pure and synchronous (no I/O, no asyncio). A slot is either free or allocated; the store
decides what an allocated slot holds. Every allocation bumps the slot's generation, so a
descriptor ``(slot, generation)`` taken before the slot was freed and reused no longer
matches and is detected, never silently read.

Free slots are kept on a LIFO stack: the slot freed last is handed out first, which keeps
recently touched (cache-warm) memory in use. Generations live in a Python list (fast to
read per slot) and, when given, are mirrored into a u64 array in shared memory (a numpy
view of the segment's generation table) for readers in other processes.
"""

from __future__ import annotations

from typing import Any, NewType

__all__ = ["SlotId", "SlotPool"]

SlotId = NewType("SlotId", int)


class SlotPool:
    """``num_slots`` fixed-size slots; ``allocate``/``free`` conserve the count."""

    def __init__(self, num_slots: int, mirror: Any = None) -> None:
        """``mirror``: a C-contiguous uint64 array of ``num_slots`` to keep in step."""
        if num_slots < 1:
            raise ValueError(f"a pool needs at least one slot, got {num_slots}")
        if mirror is not None and len(mirror) != num_slots:
            raise ValueError(f"a generation mirror of {len(mirror)} for {num_slots} slots")
        self.num_slots = num_slots
        self.generations: list[int] = [0] * num_slots  # read-only outside this class
        # e.g. the segment's u64 generation table; we are its one writer. A memoryview
        # stores a Python int per slot several times faster than numpy indexing.
        self._mirror: memoryview | None = None
        if mirror is not None:
            mirror[:] = 0
            self._mirror = memoryview(mirror).cast("B").cast("Q")
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._is_free = bytearray(b"\x01" * num_slots)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def can_allocate(self, count: int) -> bool:
        return 0 <= count <= len(self._free)

    def allocate(self, count: int) -> list[SlotId]:
        """``count`` distinct free slots, each with a new generation."""
        if not self.can_allocate(count):
            raise ValueError(f"{count} slots asked, {len(self._free)} free")
        if count == 0:
            return []
        free = self._free
        taken = free[len(free) - count :]
        del free[len(free) - count :]
        gens, is_free, mirror = self.generations, self._is_free, self._mirror
        if mirror is None:
            for slot in taken:
                is_free[slot] = 0
                gens[slot] += 1
        else:
            for slot in taken:
                is_free[slot] = 0
                gen = gens[slot] + 1
                gens[slot] = gen
                mirror[slot] = gen
        return taken  # type: ignore[return-value]  # SlotId is an int

    def renew(self, slots: list[int]) -> None:
        """Hand allocated ``slots`` (distinct) to a new holder, each with a new generation:
        what freeing and allocating them again would do, for slots the caller evicts to
        reuse at once (it knows they are allocated: no checks)."""
        gens, mirror = self.generations, self._mirror
        for slot in slots:
            gen = gens[slot] + 1
            gens[slot] = gen
            if mirror is not None:
                mirror[slot] = gen

    def free(self, slots: list[SlotId] | list[int]) -> None:
        """Return allocated slots; freeing a free or unknown slot is a bug (``ValueError``)."""
        is_free = self._is_free
        # Check everything first: a bad call changes nothing.
        if slots and (min(slots) < 0 or max(slots) >= self.num_slots
                      or any(map(is_free.__getitem__, slots))):
            bad = next(s for s in slots if not 0 <= s < self.num_slots or is_free[s])
            raise ValueError(f"slot {bad} is not allocated")
        if len(slots) > 1 and len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} name a slot twice")
        for slot in slots:
            is_free[slot] = 1
        self._free.extend(slots)

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])
