"""The block store's write-ahead grants: free slots a writer fills before it names its keys.

A writer may hold a *write-ahead grant*: free slots ``grant`` gave it before it knew its
keys, which it fills first and then ``claim``s for its keys (each becomes a reservation, or
stays granted if its key is held or in flight), so its copy need not wait for a reply.
Grants are capped store-wide (``max_granted``) because a granted slot holds no block.
"""

from __future__ import annotations

from collections.abc import Sequence

from shm.owner.store.books import GRANTED, BlockKey, SessionId
from shm.owner.store.reservations import check_extras
from shm.owner.store.standby import Standby

__all__ = ["Grants"]


class Grants(Standby):
    """``grant`` and ``claim``."""

    def grant(self, session: SessionId, want: int) -> tuple[list[int], list[int]]:
        """Top the session's write-ahead grant up to ``want`` slots, as far as the store-wide
        cap and the evictable blocks allow (never ``StoreFullError``); the slots and
        generations newly granted. A grant may evict, as a reservation would."""
        state = self._session(session)
        # (What ``settle`` would change leaves these counts as they are: on the owner's
        # usual path, a reserve's reply that asks for no grant, nothing is settled here.)
        count = min(want - len(state.granted), self.max_granted - self._num_granted,
                    self._pool.num_free_slots + len(self._lru)
                    - (self._num_leased - self._num_doomed) - self._num_standby)
        if count <= 0:
            return [], []
        self.settle()
        slots, evicted = self._take(count)
        self._drop_evicted(evicted)
        st = self._state
        for slot in slots:
            st[slot] = GRANTED
        state.granted.update(slots)
        self._num_granted += count
        return list(slots), list(map(self._pool.generations.__getitem__, slots))

    def claim(
        self,
        session: SessionId,
        keys: Sequence[BlockKey],
        slots: Sequence[int],
        generations: Sequence[int],
        parent_hashes: Sequence[int | None] | None = None,
        token_ids: Sequence[list[int] | None] | None = None,
    ) -> tuple[list[int | None], list[int | None]]:
        """Reserve granted ``slots[i]`` (already written, or being written) to ``keys[i]``.

        As ``reserve``'s reply: per key its slot and generation (unchanged), or ``None``
        where the key is held or in flight; that key's slot stays granted. Raises
        ``StaleDescriptorError`` (changing nothing) unless every slot is granted to this
        session with that generation, once.
        """
        self.settle()
        state = self._session(session)
        check_extras(len(keys), parent_hashes, token_ids)
        if len(keys) != len(slots):
            raise ValueError(f"{len(keys)} keys for {len(slots)} slots")
        self._check_descriptors(state.granted, slots, generations, "granted to")
        fresh = self._fresh(keys)
        taken = list(slots) if fresh is None else [slots[i] for i in fresh]
        state.granted.difference_update(taken)
        self._num_granted -= len(taken)
        self._num_claimed += len(taken)
        self._bind(state, keys, fresh, taken, parent_hashes, token_ids)
        return self._per_key(keys, fresh, taken)
