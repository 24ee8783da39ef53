"""The block store's leases: a get through the owner pins its blocks while it copies.

A get through the owner is ``lease`` (the slot cannot be evicted or reused while any lease
is held), a copy out, then ``release``; most gets never reach the store, they read through
the read index (``shm.read_index``). A block removed while leased keeps its slot (DOOMED)
until its last lease goes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from shm.errors import StaleDescriptorError
from shm.owner.store.books import DOOMED, BlockKey, SessionId, StoreBooks

__all__ = ["Leases"]


class Leases(StoreBooks):
    """``lease`` and ``release``, counted per slot and per session."""

    def lease(
        self, session: SessionId, keys: Sequence[BlockKey]
    ) -> tuple[list[int | None], list[int | None]]:
        """Pin each held key's slot for reading; ``None`` for keys not held."""
        self.settle()
        state = self._session(session)
        out_slots: list[int | None] = list(map(self._blocks.get, keys))
        if self._num_standby:  # a writer may overwrite a standby block: take it back first
            self._resolve_standby_of(out_slots)
            out_slots = list(map(self._blocks.get, keys))
        misses = out_slots.count(None)
        if misses:
            hit_keys = [k for k, s in zip(keys, out_slots, strict=True) if s is not None]
            slots: list[int] = [s for s in out_slots if s is not None]
        else:
            hit_keys, slots = keys, out_slots  # type: ignore[assignment]
        leases, touch = self._leases, self._lru.move_to_end
        mine = state.leases
        held = mine.get
        newly = 0
        for key, slot in zip(hit_keys, slots, strict=True):
            count = leases[slot]
            if not count:
                newly += 1
            leases[slot] = count + 1
            mine[slot] = held(slot, 0) + 1
            touch(key)  # a read makes a block recent
        self._num_leased += newly
        gens = self._pool.generations
        self._num_hits += len(keys) - misses
        self._num_misses += misses
        if not misses:
            return out_slots, list(map(gens.__getitem__, slots))
        return out_slots, [None if s is None else gens[s] for s in out_slots]

    def release(
        self, session: SessionId, slots: Sequence[int], generations: Sequence[int]
    ) -> None:
        """Give leases back (all or nothing); a block whose last lease goes becomes MRU."""
        self.settle()
        state = self._session(session)
        if len(slots) != len(generations):
            raise StaleDescriptorError(f"{len(slots)} slots with {len(generations)} generations")
        mine, gens = state.leases, self._pool.generations
        wanted = Counter(slots)
        if (list(map(gens.__getitem__, slots)) != list(generations)
                or not mine.keys() >= wanted.keys()
                or (len(wanted) != len(slots)
                    and any(mine[slot] < count for slot, count in wanted.items()))):
            for slot, generation in zip(slots, generations, strict=True):
                if wanted[slot] > mine.get(slot, 0) or gens[slot] != generation:
                    raise StaleDescriptorError(
                        f"slot {slot} generation {generation} is not leased by this client"
                    )
        for slot, count in wanted.items():
            left = mine[slot] - count
            if left:
                mine[slot] = left
            else:
                del mine[slot]
        self._drop_leases(wanted)

    def _drop_leases(self, counts: dict[int, int]) -> None:
        """Take ``counts[slot]`` leases off each slot; free removed blocks left unleased."""
        leases = self._leases
        last: list[int] = []
        for slot, count in counts.items():
            left = leases[slot] - count
            leases[slot] = left
            if not left:
                last.append(slot)
        if not last:
            return
        self._num_leased -= len(last)
        st = self._state
        doomed = [slot for slot in last if st[slot] == DOOMED]
        if doomed:
            for slot in doomed:
                self._vacate(slot)
            self._num_doomed -= len(doomed)
            self._pool.free(doomed)
            self._room_freed()
