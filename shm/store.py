"""The block store core: keys → slots, reservations, leases, LRU eviction, host-tier events.

Pure and synchronous: no sockets, no asyncio, no shared memory of its own (the owner hands
it the segment's generation table to mirror and its read index to keep in step: see
``shm.read_index``). Callers are *sessions* (one per client
connection); whatever a session holds is given back by ``close_session`` when its client
goes away.

A put is two steps: ``reserve`` hands out slots for the keys not yet held (invisible to
readers), the client copies its bytes in, then ``commit`` makes them visible and records
a ``BlockStored`` event (or the client publishes the slots in the read index, which
commits them: ``commit_published`` records it). A writer that dies between the two leaves
nothing visible: its reservations are freed with its session. A writer may also hold a
*write-ahead grant*: free slots ``grant`` gave it before it knew its keys, which it fills
first and then ``claim``s for its keys (each becomes a reservation, or stays granted if its
key is held or in flight), so its copy need not wait for a reply; grants are capped
store-wide (``max_granted``) because a granted slot holds no block.

A get through the owner is ``lease`` (the slot cannot be evicted or reused while any lease
is held), a copy out, then ``release``; most gets never reach the store, they read through
the read index.

Eviction is least-recently-used over committed blocks, skipping leased ones: ``_lru``
holds every committed block in order of last use (a commit or a lease moves a block to
the end), and eviction, done only when a reservation or a grant needs slots, takes
unleased blocks from the front (a lease no longer costs an LRU removal and a release an
LRU insertion).
With a read index, readers also use blocks without telling the store: eviction then ranks
the oldest blocks by their last use, the store's or a reader's (``_pick_victims``).
Every commit, eviction and removal is recorded as a normalized host-tier event
(``shm.host_events``), which the owner drains with ``take_events``.

State is kept per slot in flat lists rather than per-block objects: a batch of 64 keys
costs a few dictionary operations per key and no allocation beyond the reply lists. The
owner's per-key work is on every put's and get's critical path, so the common case (no key
repeated, none held) takes set-level checks and single loops. Plain loops stay where they
beat ``map`` over bound setters on CPython 3.11 (measured).
Descriptors travel as two parallel lists, ``slots`` and ``generations``.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

from kvcore.events import KVEvent
from shm.errors import StaleDescriptorError, StoreFullError
from shm.host_events import HostEventLog
from shm.pool import SlotPool
from shm.read_index import ReadIndex

__all__ = ["BlockKey", "BlockStore", "SessionId", "StoreStats"]

BlockKey = tuple[int, int]
"""``(namespace_seed, block_hash)``, both unsigned 64-bit."""
SessionId = NewType("SessionId", int)

# Blocks beyond the ones needed that an eviction ranks by last use (see ``_pick_victims``).
_EVICTION_WINDOW = 64

# What a slot holds (``_state``).
_FREE, _RESERVED, _COMMITTED, _DOOMED, _GRANTED = 0, 1, 2, 3, 4
# DOOMED: removed while leased. GRANTED: handed to a writer ahead of its keys (``grant``).


@dataclass(slots=True)
class _Session:
    reserved: set[int] = field(default_factory=set)  # slots
    leases: dict[int, int] = field(default_factory=dict)  # slot → leases held (> 0)
    granted: set[int] = field(default_factory=set)  # slots granted ahead, not yet claimed


# A reservation's books left for ``BlockStore.settle``: session, keys, fresh key indices,
# slots, evicted blocks, parent hashes, token ids.
_Unsettled = tuple[_Session, Sequence[BlockKey], list[int] | None, Sequence[int],
                   list[tuple[BlockKey, int]], Sequence[int | None] | None,
                   Sequence[list[int] | None] | None]


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


class BlockStore:
    """Fixed-size blocks under an LRU byte budget (``num_slots × block_bytes``)."""

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
        self._parent: list[int | None] = [None] * num_slots
        self._tokens: list[list[int] | None] = [None] * num_slots
        # Commit time (monotonic ns), then raised to readers' read times as eviction ranks
        # blocks (see ``_pick_victims``). A lease need not stamp it: it moves the block to
        # the back of the LRU, out of reach of the ranking until the block has aged anyway.
        self._used_ns = [0] * num_slots
        self._num_leased = 0  # slots with a lease
        self._num_doomed = 0  # removed while leased: leased, no longer in _blocks or _lru
        self._sessions: dict[SessionId, _Session] = {}
        self._later: _Unsettled | None = None  # what the last reserve left for ``settle``
        # Per slot, the order it was reserved in (``commit_published`` commits in that order).
        self._reserved_at = [0] * num_slots
        self._num_reservations = 0
        self._next_session = 1
        self._log = HostEventLog(worker_id)
        self._num_puts = self._num_hits = self._num_misses = self._num_evictions = 0

    # ----------------------------------------------------------------- sessions
    def open_session(self) -> SessionId:
        session = SessionId(self._next_session)
        self._next_session += 1
        self._sessions[session] = _Session()
        return session

    def close_session(self, session: SessionId) -> None:
        """Free the session's reservations (those its writer published are committed: see
        ``commit_published``) and release its leases."""
        self.settle()
        state = self._sessions.get(session)
        if state is None:
            return
        self._commit_published_by(state)
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

    def _session(self, session: SessionId) -> _Session:
        try:
            return self._sessions[session]
        except KeyError:
            raise StaleDescriptorError(f"session {session} is closed") from None

    def _vacate(self, slot: int) -> None:
        self._state[slot] = _FREE
        self._key[slot] = None
        self._parent[slot] = None
        self._tokens[slot] = None

    # ---------------------------------------------------------------------- put
    def reserve(
        self,
        session: SessionId,
        keys: Sequence[BlockKey],
        parent_hashes: Sequence[int | None] | None = None,
        token_ids: Sequence[list[int] | None] | None = None,
    ) -> tuple[list[int | None], list[int | None]]:
        """Slots and generations to write per key; ``None`` where the key is held or in flight.

        All or nothing: raises ``StoreFullError`` (changing nothing) when too few slots can
        be freed, i.e. when the rest of the store is leased or being written.

        A writer waits for this reply, so the books no reply depends on (the evicted blocks'
        entries and event, the reservations' records) are left for ``settle``, which every
        other call runs first: the owner answers, then settles.
        """
        self.settle()
        state = self._session(session)
        _check_extras(len(keys), parent_hashes, token_ids)
        fresh = self._fresh(keys)
        count = len(keys) if fresh is None else len(fresh)
        slots, evicted = self._take(count)
        self._later = (state, keys, fresh, slots, evicted, parent_hashes, token_ids)
        return self._per_key(keys, fresh, slots)

    def settle(self) -> None:
        """Finish the books the last ``reserve`` left for after its reply (see there)."""
        later = self._later
        if later is None:
            return
        self._later = None
        state, keys, fresh, slots, evicted, parent_hashes, token_ids = later
        self._drop_evicted(evicted)
        self._bind(state, keys, fresh, slots, parent_hashes, token_ids)

    def _fresh(self, keys: Sequence[BlockKey]) -> list[int] | None:
        """Indices of the keys to write (neither held, in flight, nor repeated); None: all."""
        blocks, reserved = self._blocks, self._reserved
        distinct = set(keys)  # each check hashes every key tuple again: skip empty books
        if (len(distinct) == len(keys) and (not blocks or blocks.keys().isdisjoint(distinct))
                and (not reserved or reserved.keys().isdisjoint(distinct))):
            return None
        seen: set[BlockKey] = set()
        return [i for i, key in enumerate(keys) if not (
            key in blocks or key in reserved or key in seen or seen.add(key))]  # type: ignore[func-returns-value]

    def _per_key(self, keys: Sequence[BlockKey], fresh: list[int] | None,
                 slots: Sequence[int]) -> tuple[list[int | None], list[int | None]]:
        """The reply to a reservation of ``slots[j]`` for key ``fresh[j]`` (every key when
        ``fresh`` is None): per key, its slot and generation, or ``None``."""
        new_gens: list[int | None] = list(map(self._pool.generations.__getitem__, slots))
        if fresh is None:
            return list(slots), new_gens
        out_slots: list[int | None] = [None] * len(keys)
        out_gens: list[int | None] = [None] * len(keys)
        for i, slot, gen in zip(fresh, slots, new_gens, strict=True):
            out_slots[i] = slot
            out_gens[i] = gen
        return out_slots, out_gens

    def _bind(
        self, state: _Session, keys: Sequence[BlockKey], fresh: list[int] | None,
        slots: Sequence[int], parent_hashes: Sequence[int | None] | None,
        token_ids: Sequence[list[int] | None] | None,
    ) -> None:
        """Record ``slots[j]`` as reserved to key ``fresh[j]`` (every key when ``fresh`` is
        None), with its parent and tokens for the stored event."""
        new_keys = list(keys) if fresh is None else [keys[i] for i in fresh]
        self._reserved.update(zip(new_keys, slots, strict=True))
        key_of, st, at = self._key, self._state, self._reserved_at
        order = self._num_reservations
        for slot, key in zip(slots, new_keys, strict=True):
            key_of[slot] = key
            st[slot] = _RESERVED
            at[slot] = order
            order += 1
        self._num_reservations = order
        if parent_hashes is not None:
            parent = self._parent
            for slot, p in zip(slots, parent_hashes if fresh is None
                               else [parent_hashes[i] for i in fresh], strict=True):
                parent[slot] = p
        if token_ids is not None:
            tokens = self._tokens
            for slot, t in zip(slots, token_ids if fresh is None
                               else [token_ids[i] for i in fresh], strict=True):
                tokens[slot] = t
        state.reserved.update(slots)

    def grant(self, session: SessionId, want: int) -> tuple[list[int], list[int]]:
        """Top the session's write-ahead grant up to ``want`` slots, as far as the store-wide
        cap and the evictable blocks allow (never ``StoreFullError``); the slots and
        generations newly granted. A grant may evict, as a reservation would."""
        state = self._session(session)
        # (What ``settle`` would change leaves these counts as they are: on the owner's
        # usual path, a reserve's reply that asks for no grant, nothing is settled here.)
        count = min(want - len(state.granted), self.max_granted - self._num_granted,
                    self._pool.num_free_slots + len(self._lru)
                    - (self._num_leased - self._num_doomed))
        if count <= 0:
            return [], []
        self.settle()
        slots, evicted = self._take(count)
        self._drop_evicted(evicted)
        st = self._state
        for slot in slots:
            st[slot] = _GRANTED
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
        _check_extras(len(keys), parent_hashes, token_ids)
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
        evictable = len(self._lru) - leased_in_lru
        if count > free + evictable:
            raise StoreFullError(
                f"{count} slots needed, {free} free and {evictable} evictable of "
                f"{pool.num_slots} ({self._num_leased} leased, "
                f"{len(self._reserved)} being written, {self._num_granted} granted ahead)"
            )
        evicted = self._pick_victims(count - free)
        reused = [slot for _, slot in evicted]
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
        if not (self._num_leased - self._num_doomed) and (index is None or need >= len(lru)):
            return [lru.popitem(last=False) for _ in range(need)]  # nothing to choose between
        leases = self._leases
        window = need if index is None else need + _EVICTION_WINDOW
        candidates: list[tuple[BlockKey, int]] = []
        for key, slot in lru.items():
            if not leases[slot]:
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

    def commit(self, session: SessionId, slots: Sequence[int], generations: Sequence[int]) -> None:
        """Make reserved blocks visible (all or nothing) and record ``BlockStored``."""
        self.settle()
        state = self._session(session)
        self._check_descriptors(state.reserved, slots, generations, "reserved by")
        self._commit(state, slots)

    def commit_published(self, sessions: Iterable[SessionId] | None = None) -> int:
        """Commit the reservations whose writers have published them in the read index.

        A writer that reads optimistically commits that way, with no message (see
        ``shm.read_index``): the owner calls this for the sessions whose publication count
        moved, before every request, so a block whose put has returned is visible to any
        request sent after it, and on a short poll, so the event goes out though no request
        comes. ``sessions``: those to look at (default: all). In the order
        the keys were reserved (one request's chain of blocks stays one ``BlockStored``);
        how many blocks.
        """
        self.settle()
        if self._index is None or not self._reserved:
            return 0
        states = (self._sessions.values() if sessions is None
                  else [self._sessions[s] for s in sessions if s in self._sessions])
        return sum(self._commit_published_by(state) for state in states)

    def _commit_published_by(self, state: _Session) -> int:
        if not state.reserved or self._index is None:
            return 0
        key_of = self._key
        done = self._index.published((key_of[slot], slot) for slot in state.reserved)  # type: ignore[misc]
        if done:
            done.sort(key=self._reserved_at.__getitem__)
            self._commit(state, done)
        return len(done)

    def _commit(self, state: _Session, slots: Sequence[int]) -> None:
        reserved, blocks, lru, key_of, st = (
            self._reserved, self._blocks, self._lru, self._key, self._state)
        index, now, used = self._index, time.monotonic_ns(), self._used_ns
        for slot in slots:
            key = key_of[slot]
            del reserved[key]  # type: ignore[arg-type]
            blocks[key] = slot  # type: ignore[index]
            lru[key] = slot  # type: ignore[index]
            st[slot] = _COMMITTED
            used[slot] = now
            if index is not None:
                index.publish_slot(slot, key)  # type: ignore[arg-type]
        state.reserved.difference_update(slots)
        self._num_puts += len(slots)
        self._emit_stored(slots)

    def abort(self, session: SessionId, slots: Sequence[int], generations: Sequence[int]) -> None:
        """Drop reservations without making anything visible."""
        self.settle()
        state = self._session(session)
        self._check_descriptors(state.reserved, slots, generations, "reserved by")
        for slot in slots:
            del self._reserved[self._key[slot]]  # type: ignore[arg-type]
            self._vacate(slot)
        state.reserved.difference_update(slots)
        if self._index is not None:
            self._index.unpublish(slots)
        self._pool.free(list(slots))

    # ---------------------------------------------------------------------- get
    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        self.settle()
        blocks = self._blocks
        return [key in blocks for key in keys]

    def lease(
        self, session: SessionId, keys: Sequence[BlockKey]
    ) -> tuple[list[int | None], list[int | None]]:
        """Pin each held key's slot for reading; ``None`` for keys not held."""
        self.settle()
        state = self._session(session)
        out_slots: list[int | None] = list(map(self._blocks.get, keys))
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
        doomed = [slot for slot in last if st[slot] == _DOOMED]
        if doomed:
            for slot in doomed:
                self._vacate(slot)
            self._num_doomed -= len(doomed)
            self._pool.free(doomed)

    # ------------------------------------------------------------------- remove
    def remove(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Drop held keys now (a leased one's slot is freed on its last release)."""
        self.settle()
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
                self._state[slot] = _DOOMED
                self._num_doomed += 1
            else:
                self._vacate(slot)
                free.append(slot)
        if self._index is not None and gone:
            self._index.retract([slot for _, slot in gone])
        self._pool.free(free)
        self._log.removed(hashes)
        return removed

    def clear(self) -> None:
        """Drop every block (leased ones when released) and record ``AllBlocksCleared``;
        what writers published first (see ``commit_published``)."""
        self.commit_published()
        if not self._blocks:
            return
        if self._index is not None:
            self._index.retract_all()
        for slot in self._blocks.values():
            if self._leases[slot]:
                self._state[slot] = _DOOMED
                self._num_doomed += 1
            else:
                self._vacate(slot)
                self._pool.free([slot])
        self._blocks.clear()
        self._lru.clear()
        self._log.cleared()

    # ------------------------------------------------------------------- events
    def take_events(self) -> list[KVEvent]:
        """Events recorded since the last call, in sequence order."""
        self.settle()
        return self._log.take()

    def _emit_stored(self, slots: Sequence[int]) -> None:
        key_of, parent, tokens = self._key, self._parent, self._tokens
        hashes = [key_of[s][1] for s in slots]  # type: ignore[index]
        parents = [parent[s] for s in slots]
        token_lists = [tokens[s] for s in slots]
        for slot in slots:  # the events carry them now; the slots need not
            parent[slot] = None
            tokens[slot] = None
        self._log.stored(hashes, parents, token_lists)

    # -------------------------------------------------------------------- stats
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
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping disagrees with itself (for tests)."""
        self.settle()
        from shm.store_checks import check_store  # noqa: PLC0415 - test support only

        check_store(self)


def _check_extras(count: int, parent_hashes: Sequence[int | None] | None,
                  token_ids: Sequence[list[int] | None] | None) -> None:
    for name, extra in (("parent hashes", parent_hashes), ("token id lists", token_ids)):
        if extra is not None and len(extra) != count:
            raise ValueError(f"{len(extra)} {name} for {count} keys")
