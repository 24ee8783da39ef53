"""The block store's standby grants: blocks a writer overwrites with its next put,
sending no message at all.

Once the store is full, a put must wait for the owner to evict before it copies, a round
trip that costs a quarter of a 256 KiB × 64 copy, and even a message sent after the copy
wakes the owner onto the writer's CPU, where its handling runs inside the writer's send.
So once a session has reserved into a full store, the owner *offers* it the least recently
used blocks, as many as its largest such put (``offer_standby``), through shared memory:
the slot list and the session's standby word in the read index (``shm.read_index``). The
blocks stay committed and readable, on standby. A put takes the grant with one
compare-and-swap of that word from OFFERED to TAKEN, retracts the slots it writes, copies,
then records the slots (their keys in the key words, parents in per-slot words), publishes
them, marks the word DONE and counts its publication. The owner picks that record up
(``_pick_up``: ``overwrite``, then the next offer) when it sees the count move: before it
handles any request, so a put that has returned is visible to every later request, and on
its poll, which runs every millisecond while a grant is taken (``grants_taken``); or at
the writer's end. Puts with token ids, or finding no grant big enough, reserve.

Until a writer takes it, the owner may take a grant back (``_resolve_standby``) by swapping
the same word to REVOKED, whenever another client needs its blocks: an eviction with no
other room, a lease, a removal, a freed slot. The swap decides: if the owner wins the
blocks are plain committed blocks again; if the writer won they are being overwritten, and
the owner drops them from its books at once (the other client's request then finds other
room, or none, as with slots being written). Eviction passes over standby blocks while
other blocks can go, so writers do not take each other's.

Standby grants need the read index and the atomic swap (``shm._atomic.AVAILABLE``), and no
tier below the store: an evicted block is handed to ``spill`` before its slot is reused, and
a writer overwrites a standby block without the owner.
"""

from __future__ import annotations

from collections.abc import Sequence

from shm._atomic import AVAILABLE
from shm.errors import StaleDescriptorError
from shm.owner.store.books import COMMITTED, STANDBY, TAKEN, BlockKey, SessionBooks, SessionId
from shm.owner.store.reservations import Reservations, check_extras
from shm.read_index import STANDBY_DONE, STANDBY_REVOKED, STANDBY_TAKEN

__all__ = ["Standby"]


class Standby(Reservations):
    """``offer_standby``, ``overwrite`` and ``_pick_up``; ``_resolve_standby`` for the other
    parts."""

    def attach_cell(self, session: SessionId, cell: int) -> None:
        """``session``'s client has read-index cell ``cell`` (its standby word): it may
        get standby grants, if this store can give them."""
        if self._index is not None and AVAILABLE and self.spill is None:
            self._session(session).cell = cell

    @property
    def awaits_writers(self) -> bool:
        """Whether a writer may commit without a message: reservations open, or standby
        grants offered, taken or due (the owner polls for them)."""
        if self._reserved or self._num_standby or self._offers_due:
            return True
        return any(s.taken for s in self._sessions.values())

    @property
    def standby_offered(self) -> bool:
        """Whether any standby grant is out (offered or taken, as far as the books know)."""
        return bool(self._num_standby)

    @property
    def grants_taken(self) -> bool:
        """Whether a writer is putting over a standby grant (its word TAKEN or DONE): the
        owner then polls at its shortest interval, so the put is picked up soon."""
        index = self._index
        if index is None:
            return False
        return any(state.taken or (state.standby and index.standby_state(
            state.cell, state.standby_epoch) in (STANDBY_TAKEN, STANDBY_DONE))
            for state in self._sessions.values())

    def offer_standby(self, session: SessionId, want: int = -1) -> tuple[list[int], int]:
        """Offer ``session`` up to ``want`` (default: the largest put it reserved into a
        full store) of the least recently used unleased blocks, if the store has fewer
        free slots than that and the session holds no write-ahead grant (``Grants``); its
        grant before is taken back first. The offer goes to the client through its standby
        word; returns the slots and the grant's epoch (``[], 0``: none)."""
        state = self._session(session)
        if state.standby:
            self._resolve_standby(state)
        if want < 0:
            want = state.standby_want
        index, cell = self._index, state.cell
        if (index is None or cell < 0 or want <= 0 or not AVAILABLE or self.spill is not None
                or state.taken or state.granted or self._pool.num_free_slots >= want):
            return [], 0  # a writer holding write-ahead grants claims them instead
        st, leases = self._state, self._leases
        slots: list[int] = []
        for slot in self._lru.values():
            if st[slot] == COMMITTED and not leases[slot]:
                slots.append(slot)
                if len(slots) == want:
                    break
        if not slots:
            return [], 0
        holders = self._standby_of
        for slot in slots:
            st[slot] = STANDBY
            holders[slot] = state
        self._num_standby += len(slots)
        epoch = self._next_epoch
        self._next_epoch += 1
        state.standby, state.standby_epoch = slots, epoch
        index.offer_standby(cell, epoch, slots)
        return slots, epoch

    def _pick_up(self, state: SessionBooks) -> int:
        """Commit what ``state``'s writer recorded over its standby grant (its word DONE:
        the slots it wrote, their keys published, parents in the index), and queue the
        session for its next grant (``offer_due``: after the reply, a reserve of its own
        may need those blocks). How many blocks it committed."""
        index, epoch, done = self._index, state.standby_epoch, 0
        if index is not None and (state.standby or state.taken) and (
                index.standby_state(state.cell, epoch) == STANDBY_DONE):
            written = index.grant_slots(state.cell)
            grant = set(state.standby or state.taken)
            seen: set[int] = set()  # a bad record's slots (outside the grant, twice): ignored
            written = [slot for slot in written if slot in grant
                       and not (slot in seen or seen.add(slot))]  # type: ignore[func-returns-value]
            spoiled = [slot for slot in state.standby
                       if slot not in seen and index.is_retracted(slot)]
            got, _ = self.overwrite(state.session, epoch, index.keys_of(written), written,
                                    spoiled, index.recorded_parents(written))
            done = sum(slot is not None for slot in got)
        if state.standby_want and not state.standby and not state.taken:
            self._offers_due[state.session] = state
        return done

    def offer_due(self) -> None:
        """Offer their next grant to the sessions ``_pick_up`` queued (the owner calls this
        after its reply, and on its poll)."""
        due, self._offers_due = self._offers_due, {}
        for session, state in due.items():
            if session in self._sessions and not state.standby and not state.taken:
                self.offer_standby(session)

    def overwrite(
        self,
        session: SessionId,
        epoch: int,
        keys: Sequence[BlockKey],
        slots: Sequence[int],
        spoiled: Sequence[int] = (),
        parent_hashes: Sequence[int | None] | None = None,
        token_ids: Sequence[list[int] | None] | None = None,
    ) -> tuple[list[int | None], list[int | None]]:
        """Commit ``keys[i]``, which the writer has copied into slot ``slots[i]`` of its
        standby grant ``epoch`` (taken) and published. ``spoiled``: slots of the grant it
        retracted but did not fill; the rest of the grant it left alone.

        As ``reserve``'s reply: per key its slot and new generation, or ``None`` where the
        key was held, in flight or repeated (that copy is dropped). Raises
        ``StaleDescriptorError`` (changing nothing) unless the grant is this session's and
        taken, and the slots are its own, once each.
        """
        self.settle()
        state = self._session(session)
        check_extras(len(keys), parent_hashes, token_ids)
        if len(keys) != len(slots):
            raise ValueError(f"{len(keys)} keys for {len(slots)} slots")
        grant = state.standby or state.taken
        index = self._index
        if (not grant or epoch != state.standby_epoch or index is None
                or index.standby_state(state.cell, epoch) not in (STANDBY_TAKEN, STANDBY_DONE)):
            raise StaleDescriptorError(f"standby grant {epoch} is not taken by this client")
        touched = {*slots, *spoiled}
        if len(touched) != len(slots) + len(spoiled) or not touched.issubset(grant):
            raise StaleDescriptorError(f"slots outside standby grant {epoch}, or named twice")
        st, pool = self._state, self._pool
        freed = list(spoiled)
        if state.standby:  # our books still hold the old blocks: drop those overwritten
            self._unhold(state)
            evicted: list[tuple[BlockKey, int]] = []
            lru, key_of = self._lru, self._key
            for slot in grant:
                if slot in touched:
                    key = key_of[slot]
                    del lru[key]  # type: ignore[arg-type]
                    evicted.append((key, slot))  # type: ignore[arg-type]
                    self._vacate(slot)
                else:
                    st[slot] = COMMITTED
            self._drop_evicted(evicted)
        else:  # dropped when taken: what the writer left alone still shows its old block
            state.taken = []
            freed += [slot for slot in grant if slot not in touched]
        fresh = self._fresh(keys)
        written = list(slots) if fresh is None else [slots[i] for i in fresh]
        if fresh is not None:  # another copy of those keys is held or in flight: drop ours
            kept = set(written)
            freed += [slot for slot in slots if slot not in kept]
        if freed:
            for slot in freed:
                self._vacate(slot)
            index.unpublish(freed)
            pool.free(freed)
        pool.renew(written)
        self._bind(state, keys, fresh, written, parent_hashes, token_ids)
        self._commit(state, written)  # published by the writer, which needs no reply
        self._num_overwrites += len(written)
        return self._per_key(keys, fresh, written)

    def _unhold(self, state: SessionBooks) -> None:
        """Forget ``state``'s offered slots as standby (the caller says what they become)."""
        holders = self._standby_of
        for slot in state.standby:
            del holders[slot]
        self._num_standby -= len(state.standby)
        state.standby = []

    def _resolve_standby(self, state: SessionBooks) -> None:
        """Take ``state``'s offered grant back (its blocks become plain committed blocks),
        or, if its writer has taken it, drop its blocks: they are being overwritten, and
        their slots wait for the writer's ``overwrite`` (or its session's end)."""
        slots = state.standby
        if not slots or self._index is None:
            return
        self._unhold(state)
        st = self._state
        if self._index.swap_standby(state.cell, state.standby_epoch, STANDBY_REVOKED):
            for slot in slots:
                st[slot] = COMMITTED
            return
        lru, key_of = self._lru, self._key
        evicted: list[tuple[BlockKey, int]] = []
        for slot in slots:
            key = key_of[slot]
            del lru[key]  # type: ignore[arg-type]
            evicted.append((key, slot))  # type: ignore[arg-type]
            self._vacate(slot)
            st[slot] = TAKEN
        self._drop_evicted(evicted)
        state.taken = slots

    def _resolve_all_standby(self) -> None:
        """Resolve every session's standby grant (the store has no other room)."""
        for state in list({id(s): s for s in self._standby_of.values()}.values()):
            self._resolve_standby(state)

    def _free_taken(self, state: SessionBooks) -> None:
        """(A session's end, once what its writer recorded is picked up.) Free the slots it
        took and never accounted for."""
        self._resolve_standby(state)
        slots, state.taken = state.taken, []
        if slots:
            for slot in slots:
                self._vacate(slot)
            if self._index is not None:
                self._index.unpublish(slots)
            self._pool.free(slots)
