"""The block store's LRU and eviction: which blocks make room when a put needs slots.

Eviction is least-recently-used over committed blocks, skipping leased ones and, while
others can go, those on standby for a writer (``shm.owner.store.standby``): ``_lru``
holds every committed block in order of last use (a commit or a lease moves a block to
the end), and eviction, done only when a reservation or a grant needs slots, takes
unleased blocks from the front (a lease costs no LRU removal and a release no LRU
insertion). An evicted block's bytes are handed to ``spill`` (the owner's disk tier), when
set, before its slot gets a new holder. With a read index, readers also use blocks without
telling the store: eviction then ranks the oldest blocks by their last use, the store's or a
reader's (``_pick_victims``).
"""

from __future__ import annotations

from collections.abc import Sequence

from shm.errors import StoreFullError
from shm.owner.store.books import STANDBY, BlockKey, StoreBooks

__all__ = ["Eviction"]

# Blocks beyond the ones needed that an eviction ranks by last use (see ``_pick_victims``).
_EVICTION_WINDOW = 64


class Eviction(StoreBooks):
    """Slots for new holders: free ones first, then the least recently used blocks'."""

    def _take(self, count: int) -> tuple[Sequence[int], list[tuple[BlockKey, int]]]:
        """``count`` slots for a new holder, each with a new generation: the free ones, then
        those of the least recently used blocks, evicted (retracted from the read index at
        once; their entries stay until ``_drop_evicted``). Also the evicted blocks.

        Raises ``StoreFullError`` (changing nothing) if too few blocks can be evicted.
        """
        pool = self._pool
        free = pool.num_free_slots
        if count <= free:
            return pool.allocate(count), []
        leased_in_lru = self._num_leased - self._num_doomed
        evictable = len(self._lru) - leased_in_lru - self._num_standby
        if count > free + evictable and self._num_standby:  # no other room: take them back
            self._resolve_all_standby()
            evictable = len(self._lru) - leased_in_lru
        if count > free + evictable:
            raise StoreFullError(
                f"{count} slots needed, {free} free and {evictable} evictable of "
                f"{pool.num_slots} ({self._num_leased} leased, "
                f"{len(self._reserved)} being written, {self._num_granted} granted ahead)"
            )
        evicted = self._pick_victims(count - free)
        reused = [slot for _, slot in evicted]
        parent = self._parent
        if self.spill is not None:  # before the slots get new holders
            self.spill(evicted, [parent[slot] for slot in reused])
        for slot in reused:
            parent[slot] = None
        if self._index is not None:
            self._index.retract(reused)
        pool.renew(reused)
        return [*pool.allocate(free), *reused], evicted

    def _drop_evicted(self, evicted: list[tuple[BlockKey, int]]) -> None:
        """Forget blocks ``_take`` evicted (their slots have new holders) and record it."""
        if evicted:
            blocks = self._blocks
            for key, _ in evicted:
                del blocks[key]
            self._num_evictions += len(evicted)
            self._log.removed([key[1] for key, _ in evicted])

    def _pick_victims(self, need: int) -> list[tuple[BlockKey, int]]:
        """The ``need`` least recently used unleased blocks, taken out of the LRU.

        With a read index, readers also use blocks without telling us (``ReadIndex``): the
        oldest unleased blocks by our order, ``need`` plus a window of them, are ranked by
        their last use, ours or a reader's, and the oldest go; those read since we last
        used them move to the back, in the order they were read. Our last use of a block is
        its commit time, or, for a block our LRU order puts behind a newer one (a lease moved
        it), that newer one's.
        """
        lru, index = self._lru, self._index
        if (not (self._num_leased - self._num_doomed) and not self._num_standby
                and (index is None or need >= len(lru))):
            return [lru.popitem(last=False) for _ in range(need)]  # nothing to choose between
        leases, st = self._leases, self._state
        window = need if index is None else need + _EVICTION_WINDOW
        candidates: list[tuple[BlockKey, int]] = []
        for key, slot in lru.items():
            if not leases[slot] and st[slot] != STANDBY:  # standby: the last resort (``_take``)
                candidates.append((key, slot))
                if len(candidates) == window:
                    break
        if index is not None and len(candidates) > need:
            used, read = self._used_ns, index.last_read_ns
            last_use: dict[int, int] = {}
            ours = 0  # our last use of a block is no earlier than of any block before it
            for _, slot in candidates:
                ours = max(ours, used[slot])
                last_use[slot] = max(ours, read(slot))
            candidates.sort(key=lambda item: last_use[item[1]])  # stable: ties keep LRU order
            for key, slot in candidates[need:]:
                if last_use[slot] > used[slot]:
                    used[slot] = last_use[slot]
                    lru.move_to_end(key)
        victims = candidates[:need]
        for key, _ in victims:
            del lru[key]
        return victims
