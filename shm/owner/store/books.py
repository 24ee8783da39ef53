"""The block store's books: what every slot holds, per session what it holds, the counters.

``StoreBooks`` owns the state that the store's parts (``eviction``, ``leases``,
``reservations``, ``grants``, assembled into ``BlockStore``) read and write, and the checks
they share: a session's books, a slot's vacating, a request's descriptors. State is kept
per slot in flat lists rather than per-block objects: a batch of 64 keys costs a few
dictionary operations per key and no allocation beyond the reply lists. The parts are
mixins of this one class rather than objects of their own because they share these
lists slot by slot: a separate object per part would put an attribute hop or a call
between the owner and the books on every request, the critical path of every put and get.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

from shm.errors import StaleDescriptorError
from shm.host_events import HostEventLog
from shm.owner.pool import SlotPool
from shm.read_index import ReadIndex

__all__ = [
    "COMMITTED",
    "DOOMED",
    "FREE",
    "GRANTED",
    "RESERVED",
    "STANDBY",
    "TAKEN",
    "BlockKey",
    "SessionBooks",
    "SessionId",
    "StoreBooks",
    "Unsettled",
]

BlockKey = tuple[int, int]
"""``(namespace_seed, block_hash)``, both unsigned 64-bit."""
SessionId = NewType("SessionId", int)

# What a slot holds (``StoreBooks._state``). DOOMED: removed while leased. GRANTED: handed
# to a writer ahead of its keys (``Grants.grant``). STANDBY: a committed block offered to a
# writer to overwrite (``Standby``); TAKEN: such a slot its writer is overwriting.
FREE, RESERVED, COMMITTED, DOOMED, GRANTED, STANDBY, TAKEN = 0, 1, 2, 3, 4, 5, 6


@dataclass(slots=True)
class SessionBooks:
    """What one session (one client connection) holds."""

    reserved: set[int] = field(default_factory=set)  # slots
    leases: dict[int, int] = field(default_factory=dict)  # slot → leases held (> 0)
    granted: set[int] = field(default_factory=set)  # slots granted ahead, not yet claimed
    # The standby grant (``Standby``): its epoch, its slots while offered (STANDBY), and
    # those its writer took (TAKEN) as far as the owner knows; the session's standby word.
    standby_epoch: int = 0
    standby: list[int] = field(default_factory=list)
    taken: list[int] = field(default_factory=list)
    cell: int = -1  # -1: no standby grants (no cell, no atomic swap, or a lower tier)
    standby_want: int = 0  # the largest put it reserved into a full store: its grant's size
    session: SessionId = SessionId(0)


# A reservation's books left for ``Reservations.settle``: session, keys, fresh key indices,
# slots, evicted blocks, parent hashes, token ids.
Unsettled = tuple[SessionBooks, Sequence[BlockKey], list[int] | None, Sequence[int],
                  list[tuple[BlockKey, int]], Sequence[int | None] | None,
                  Sequence[list[int] | None] | None]


class StoreBooks(ABC):
    """The state of a store of ``num_slots`` fixed-size blocks (see the module docstring)."""

    def __init__(
        self, num_slots: int, *, worker_id: str, generation_mirror: Any = None,
        read_index: ReadIndex | None = None, max_granted: int = 0,
    ) -> None:
        """``read_index``: the segment's index to keep in step for optimistic readers.
        ``max_granted``: slots all sessions together may hold as write-ahead grants."""
        if max_granted < 0:
            raise ValueError(f"max_granted must be >= 0, got {max_granted}")
        self._pool = SlotPool(num_slots, generation_mirror)
        self.max_granted = min(max_granted, num_slots)
        self._num_granted = self._num_claimed = 0
        self._index = read_index
        self.worker_id = worker_id
        self._blocks: dict[BlockKey, int] = {}  # committed, visible: key → slot
        self._reserved: dict[BlockKey, int] = {}  # being written, invisible
        self._lru: OrderedDict[BlockKey, int] = OrderedDict()  # committed, by last use
        self._key: list[BlockKey | None] = [None] * num_slots
        self._state = bytearray(num_slots)
        self._leases = [0] * num_slots
        # A block's parent stays while it is held (an evicted block spills with it).
        self._parent: list[int | None] = [None] * num_slots
        self._tokens: list[list[int] | None] = [None] * num_slots
        # Commit time (monotonic ns), then raised to readers' read times as eviction ranks
        # blocks (see ``Eviction._pick_victims``). A lease need not stamp it: it moves the
        # block to the back of the LRU, out of reach of the ranking until it has aged anyway.
        self._used_ns = [0] * num_slots
        self._num_leased = 0  # slots with a lease
        self._num_doomed = 0  # removed while leased: leased, no longer in _blocks or _lru
        self._sessions: dict[SessionId, SessionBooks] = {}
        self._later: Unsettled | None = None  # what the last reserve left for ``settle``
        # Per slot, the order it was reserved in (``commit_published`` commits in that order).
        self._reserved_at = [0] * num_slots
        self._num_reservations = 0
        self._next_session = 1
        self._num_standby = 0  # slots on standby, all sessions
        self._standby_of: dict[int, SessionBooks] = {}  # standby slot → its writer's books
        self._next_epoch = 1
        self._offers_due: dict[SessionId, SessionBooks] = {}  # sessions owed a new grant
        self._num_overwrites = 0  # blocks put over standby slots
        self._log = HostEventLog(worker_id)
        self._num_puts = self._num_hits = self._num_misses = self._num_evictions = 0
        # Called with the blocks an eviction takes, ``(key, slot)``, and their parents, while
        # their slots still hold their bytes (the owner's disk tier copies them out:
        # ``shm.tiers.disk_tier``).
        self.spill: Callable[[list[tuple[BlockKey, int]], list[int | None]], None] | None = None
        # Called with the blocks a commit makes visible, ``(key, slot)``, and their parents
        # (the owner's write-through remote tier queues them: ``shm.tiers.remote_tier``).
        self.committed: Callable[[list[tuple[BlockKey, int]], list[int | None]], None] | None = (
            None)

    @abstractmethod
    def settle(self) -> None:
        """Finish the books the last reservation left for after its reply (see
        ``Reservations.settle``); every other call runs it first."""

    @abstractmethod
    def _resolve_standby(self, state: SessionBooks) -> None:
        """Take ``state``'s standby grant back, or learn its writer took it (see
        ``Standby._resolve_standby``); before any use of its blocks but the writer's."""

    @abstractmethod
    def _pick_up(self, state: SessionBooks) -> int:
        """Commit what ``state``'s writer put over its standby grant (``Standby._pick_up``)."""

    @abstractmethod
    def _resolve_all_standby(self) -> None:
        """Resolve every session's standby grant (``Standby._resolve_all_standby``)."""

    def _room_freed(self) -> None:
        """Slots were freed: take the standby grants back, so that no writer overwrites a
        block while a free slot could take its put."""
        if self._num_standby and self._pool.num_free_slots:
            self._resolve_all_standby()

    def _resolve_standby_of(self, slots: Sequence[int | None]) -> None:
        """Resolve the standby grants holding any of ``slots`` (``None`` entries skipped)."""
        holders = self._standby_of
        for slot in slots:
            state = holders.get(slot) if slot is not None else None
            if state is not None:
                self._resolve_standby(state)

    def open_session(self) -> SessionId:
        session = SessionId(self._next_session)
        self._next_session += 1
        self._sessions[session] = SessionBooks(session=session)
        return session

    def _session(self, session: SessionId) -> SessionBooks:
        try:
            return self._sessions[session]
        except KeyError:
            raise StaleDescriptorError(f"session {session} is closed") from None

    def _vacate(self, slot: int) -> None:
        self._state[slot] = FREE
        self._key[slot] = None
        self._parent[slot] = None
        self._tokens[slot] = None

    def _check_descriptors(
        self, mine: set[int], slots: Sequence[int], generations: Sequence[int], held: str,
    ) -> None:
        """Raise ``StaleDescriptorError`` unless every slot is in ``mine`` (the session's
        reserved or granted slots: ``held`` says which, for the message) with that
        generation, once."""
        if len(slots) != len(generations):
            raise StaleDescriptorError(f"{len(slots)} slots with {len(generations)} generations")
        gens = self._pool.generations
        if not mine.issuperset(slots) or list(map(gens.__getitem__, slots)) != list(generations):
            for slot, generation in zip(slots, generations, strict=True):
                if slot not in mine or gens[slot] != generation:
                    raise StaleDescriptorError(
                        f"slot {slot} generation {generation} is not {held} this client"
                    )
        if len(slots) > 1 and len(set(slots)) != len(slots):
            raise StaleDescriptorError("a request names the same slot twice")
