"""``BlockStore``: the parts of the store core assembled, with sessions, removal and stats.

See the package docstring (``shm.owner.store``) for the whole; this module adds what spans the
parts: closing a session (its reservations, grants and leases go together), ``contains``,
``remove`` and ``clear``, the host-tier events and the statistics.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvcore.events import KVEvent
from shm.owner.store.books import DOOMED, BlockKey, SessionId
from shm.owner.store.grants import Grants
from shm.owner.store.leases import Leases

__all__ = ["BlockStore", "StoreStats"]


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A point-in-time view of the store, for tests, health and metrics."""

    num_slots: int
    num_free_slots: int
    num_blocks: int
    num_reserved: int
    num_leased_blocks: int
    num_sessions: int
    num_puts: int
    num_hits: int
    num_misses: int
    num_evictions: int
    num_optimistic_hits: int = 0  # of num_hits, read through the read index (the owner's)
    num_granted: int = 0  # slots granted to writers ahead of their puts, not yet claimed
    num_claimed: int = 0  # blocks claimed in granted slots: put with no reserve round trip
    num_standby: int = 0  # committed blocks offered to writers to overwrite, not yet taken
    num_overwrites: int = 0  # blocks put over standby blocks: no message at all
    # The owner's disk tier (``shm.tiers.disk_tier``; all 0 without one).
    num_disk_blocks: int = 0
    num_disk_writes: int = 0
    num_disk_reads: int = 0  # blocks promoted back into shared memory
    num_disk_corrupt: int = 0  # dropped: their file failed its check
    num_disk_errors: int = 0
    num_disk_dropped: int = 0  # evicted blocks not kept: the writer fell behind
    # The owner's remote tier (``shm.tiers.remote_tier``; all 0 without one).
    remote_connected: bool = False
    num_remote_blocks: int = 0  # what the shared store holds in this scope
    num_remote_writes: int = 0
    num_remote_reads: int = 0  # blocks promoted back into shared memory
    num_remote_misses: int = 0  # listed, then gone when read
    num_remote_corrupt: int = 0  # values that failed their check (deleted)
    num_remote_errors: int = 0  # failed calls to the store (each a miss or a block not written)
    num_remote_dropped: int = 0  # blocks not written: queue full or the store away
    num_remote_pending: int = 0  # blocks queued for writing


class BlockStore(Grants, Leases):
    """Fixed-size blocks under an LRU byte budget (``num_slots × block_bytes``).

    ``BlockStore(num_slots, worker_id=..., generation_mirror=..., read_index=...,
    max_granted=...)``: the arguments are ``StoreBooks``'s."""

    def close_session(self, session: SessionId) -> None:
        """Free the session's reservations (those its writer published are committed: see
        ``commit_published``) and release its leases."""
        self.settle()
        state = self._sessions.get(session)
        if state is None:
            return
        state.standby_want = 0  # its last put over a grant is picked up here, none offered
        self._commit_published_by(state)
        self._free_taken(state)
        del self._sessions[session]
        slots = list(state.reserved)
        for slot in slots:
            del self._reserved[self._key[slot]]  # type: ignore[arg-type]
            self._vacate(slot)
        for slot in state.granted:
            self._vacate(slot)
        self._num_granted -= len(state.granted)
        slots += state.granted
        if self._index is not None:  # its writer may have published them before dying
            self._index.unpublish(slots)
        self._pool.free(slots)
        self._drop_leases(state.leases)
        self._room_freed()

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        self.settle()
        blocks = self._blocks
        return [key in blocks for key in keys]

    def keys_of_hashes(self, block_hashes: Collection[int]) -> dict[int, BlockKey]:
        """The committed keys whose block hash is among ``block_hashes``, by hash (a peer
        that knows a block by its hash alone: ``BlockStoreOwner.keys_named``). A scan of
        the store: for a request's prefix, not for a hot path."""
        self.settle()
        if not block_hashes:
            return {}
        return {key[1]: key for key in self._blocks if key[1] in block_hashes}

    def slots_of(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """Where committed keys are held now (no lease, no use: their bytes may be read
        until the next call that can evict)."""
        self.settle()
        return list(map(self._blocks.get, keys))

    def remove(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Drop held keys now (a leased one's slot is freed on its last release)."""
        self.settle()
        if self._num_standby:  # a writer may overwrite a standby block: take it back first
            self._resolve_standby_of(list(map(self._blocks.get, keys)))
        removed: list[bool] = []
        hashes: list[int] = []
        free: list[int] = []
        gone: list[tuple[BlockKey, int]] = []
        for key in keys:
            slot = self._blocks.pop(key, None)
            removed.append(slot is not None)
            if slot is None:
                continue
            hashes.append(key[1])
            gone.append((key, slot))
            del self._lru[key]
            if self._leases[slot]:
                self._state[slot] = DOOMED
                self._num_doomed += 1
            else:
                self._vacate(slot)
                free.append(slot)
        if self._index is not None and gone:
            self._index.retract([slot for _, slot in gone])
        self._pool.free(free)
        if free:
            self._room_freed()
        self._log.removed(hashes)
        return removed

    def clear(self) -> None:
        """Drop every block (leased ones when released) and record ``AllBlocksCleared``;
        what writers published first (see ``commit_published``)."""
        self.commit_published()
        self._resolve_all_standby()
        if not self._blocks:
            return
        if self._index is not None:
            self._index.retract_all()
        for slot in self._blocks.values():
            if self._leases[slot]:
                self._state[slot] = DOOMED
                self._num_doomed += 1
            else:
                self._vacate(slot)
                self._pool.free([slot])
        self._blocks.clear()
        self._lru.clear()
        self._log.cleared()

    def take_events(self) -> list[KVEvent]:
        """Events recorded since the last call, in sequence order."""
        self.settle()
        return self._log.take()

    def room(self) -> int:
        """How many blocks a reservation could take now: free slots, and unleased blocks
        to evict."""
        self.settle()
        return self._pool.num_free_slots + len(self._lru) - (self._num_leased - self._num_doomed)

    @property
    def num_reserved(self) -> int:
        """Slots reserved to writers and not committed or aborted yet."""
        self.settle()
        return len(self._reserved)

    def stats(self) -> StoreStats:
        self.settle()
        return StoreStats(
            num_slots=self._pool.num_slots,
            num_free_slots=self._pool.num_free_slots,
            num_blocks=len(self._blocks),
            num_reserved=len(self._reserved),
            num_leased_blocks=self._num_leased,
            num_sessions=len(self._sessions),
            num_puts=self._num_puts,
            num_hits=self._num_hits,
            num_misses=self._num_misses,
            num_evictions=self._num_evictions,
            num_granted=self._num_granted,
            num_claimed=self._num_claimed,
            num_standby=self._num_standby,
            num_overwrites=self._num_overwrites,
        )
