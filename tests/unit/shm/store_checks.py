"""The block store's consistency checks, for tests: ``check_store(store)``.

They read the store's private books on purpose: the point is to check them against each
other and against the slot pool and the read index.
"""

from __future__ import annotations

from shm.owner.store import BlockStore
from shm.owner.store.books import COMMITTED, DOOMED, FREE, GRANTED, RESERVED, STANDBY, TAKEN

__all__ = ["check_store"]


def check_store(store: BlockStore) -> None:
    """Raise ``AssertionError`` if the store's bookkeeping disagrees with itself (after
    settling the books the last reservation left for after its reply)."""
    store.settle()
    pool, st = store._pool, store._state
    used = [s for s in range(pool.num_slots) if st[s] != FREE]
    if len(used) + pool.num_free_slots != pool.num_slots:
        raise AssertionError(f"{len(used)} used + {pool.num_free_slots} free slots != "
                             f"{pool.num_slots}")
    if any(pool.is_free(s) for s in used):
        raise AssertionError("a used slot is also on the free list")
    if sorted(store._blocks.values()) != sorted(s for s in used if st[s] in (COMMITTED,
                                                                              STANDBY)):
        raise AssertionError("the index disagrees with the committed slots")
    standby = sorted(s for state in store._sessions.values() for s in state.standby)
    if (standby != sorted(s for s in used if st[s] == STANDBY)
            or standby != sorted(store._standby_of) or store._num_standby != len(standby)):
        raise AssertionError("the sessions' standby grants disagree with the standby slots")
    if any(store._leases[s] for s in standby):
        raise AssertionError("a standby block is leased")
    taken = sorted(s for state in store._sessions.values() for s in state.taken)
    if taken != sorted(s for s in used if st[s] == TAKEN):
        raise AssertionError("the sessions' taken grants disagree with the taken slots")
    if sorted(store._reserved.values()) != sorted(s for s in used if st[s] == RESERVED):
        raise AssertionError("the reservations disagree with the reserved slots")
    if store._blocks != dict(store._lru):
        raise AssertionError("the LRU does not hold exactly the committed blocks")
    granted = sorted(s for state in store._sessions.values() for s in state.granted)
    if granted != sorted(s for s in used if st[s] == GRANTED):
        raise AssertionError("the sessions' grants disagree with the granted slots")
    if store._num_granted != len(granted) or len(granted) > store.max_granted:
        raise AssertionError(f"{store._num_granted} granted counted, {len(granted)} held, "
                             f"cap {store.max_granted}")
    by_sessions: dict[int, int] = {}
    for state in store._sessions.values():
        for slot, count in state.leases.items():
            by_sessions[slot] = by_sessions.get(slot, 0) + count
    if by_sessions != {s: n for s, n in enumerate(store._leases) if n}:
        raise AssertionError("lease counts disagree with the sessions holding them")
    if store._num_leased != len(by_sessions):
        raise AssertionError("the leased-block count is off")
    if store._num_doomed != sum(st[s] == DOOMED for s in used):
        raise AssertionError("the removed-while-leased count is off")
    if any(st[s] == DOOMED and not store._leases[s] for s in used):
        raise AssertionError("a removed block kept its slot with no lease left")
    if store._index is not None:
        readable = {s for s in range(pool.num_slots) if not store._index.seq[s] & 1}
        committed = set(store._blocks.values())
        # A reserved slot may be readable too: its writer's publication commits it, which
        # the store records later (``commit_published``); a granted one may not (its writer
        # publishes only what its claim reserved).
        # A standby slot its writer has taken (the owner does not know yet) is being
        # overwritten: retracted, then published with its new key, which the owner then
        # learns from the writer's ``overwrite``; a taken one likewise.
        if not (committed - set(standby) <= readable
                <= committed | set(store._reserved.values()) | set(taken)):
            raise AssertionError("the read index shows other slots than the committed")
        for key, slot in store._blocks.items():
            if st[slot] == STANDBY:
                continue
            if tuple(int(w) for w in store._index.keys[slot]) != key:
                raise AssertionError(f"the read index holds the wrong key for slot {slot}")
