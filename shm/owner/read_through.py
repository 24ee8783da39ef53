"""The host store over the tiers below it (disk, remote): evicted blocks spill down, and a
lease's misses that a lower tier holds are promoted back into shared memory before the lease
is answered.

The owner (``shm.owner.server``) builds one ``ReadThrough`` when it has lower tiers and hands it
its leases; without them, a lease is the store's alone. Promotion reserves slots for the
missed blocks some lower tier holds (as many as the store has room for; each from the first
tier, in order, that holds it), reads them into those slots (``read_many`` of each tier, in
parallel, when the reply may come later, else ``read_into`` here: a remote tier misses
then), commits them (a host ``BlockStored``) and leases them too. The hits are leased first,
so promotion's evictions never take them; a promoted block counts as a miss, then a hit.

Blocks travel with their canonical names (``shm.block_names``): an evicted block spills with
the name the store's blocks are known by, and a promoted one brings back the name its tier
kept, so its host event names it too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import structlog

from kvcore.events import KVEvent
from shm.block_names import BlockName, BlockNames
from shm.errors import BlockStoreError, StoreFullError
from shm.owner.store import BlockKey, BlockStore, SessionId
from shm.protocol import ErrorReply, Slots, encode

__all__ = ["LowerTier", "ReadThrough"]

log = structlog.get_logger(component="shm")

# (index in the lease's keys, key, slot, generation, the tier read from) of a promotion
_Planned = tuple[int, BlockKey, int, int, "LowerTier"]


class LowerTier(Protocol):
    """A tier below the host store (``shm.tiers.disk_tier``, ``shm.tiers.remote_tier``)."""

    def contains(self, key: BlockKey) -> bool: ...
    def touch(self, keys: Sequence[BlockKey]) -> None: ...
    def read_into(self, key: BlockKey, dst: np.ndarray) -> bool: ...
    async def read_many(self, items: Sequence[tuple[BlockKey, np.ndarray]]) -> list[bool]: ...
    def spill(self, blocks: Sequence[tuple[BlockKey, int]], names: Sequence[BlockName | None],
              rows: np.ndarray) -> None: ...
    def name_of(self, key: BlockKey) -> BlockName | None: ...
    def remove(self, keys: Sequence[BlockKey]) -> list[bool]: ...
    def take_events(self) -> list[KVEvent]: ...
    async def aclose(self) -> None: ...


class ReadThrough:
    """Spill and promotion between one ``BlockStore`` and the tiers below it, in order."""

    def __init__(
        self,
        tiers: Sequence[LowerTier],
        store: BlockStore,
        rows: Any,
        current_store: Callable[[], BlockStore | None],
        drain_events: Callable[[], None],
        names: BlockNames,
    ) -> None:
        self.tiers = list(tiers)
        self.store = store
        self.names = names
        self.rows = rows  # (num_slots, block_bytes) uint8 rows of the segment
        self.session = store.open_session()  # the promotions' store session
        self.num_spill_errors = 0
        self.promotions: set[asyncio.Task[bytes]] = set()  # leases reading lower tiers
        self._current_store = current_store  # the owner's store (None once it closed)
        self._drain_events = drain_events
        store.spill = self.spill

    async def finish(self) -> None:
        """Wait for the promotions in flight (their reads fill slots of the segment)."""
        while self.promotions:
            await asyncio.gather(*self.promotions, return_exceptions=True)

    def lease(
        self, session: SessionId, keys: list[BlockKey], defer: bool
    ) -> bytes | asyncio.Task[bytes]:
        """``store.lease``, reading what shared memory misses through the lower tiers.

        ``defer``: the reply may come later: the tiers then read in the background and the
        reply is the task's result (see ``Connection``); else they are read here.
        """
        store = self.store
        slots, gens = store.lease(session, keys)
        if None not in slots:
            return encode(Slots(slots, gens))
        plan = self._reserve(keys, [i for i, slot in enumerate(slots) if slot is None])
        if not plan:
            return encode(Slots(slots, gens))
        rows = self.rows
        if not defer:
            read = [tier.read_into(key, rows[slot]) for _, key, slot, _, tier in plan]
            return self._promoted(session, keys, slots, gens, plan, read)

        async def promote() -> bytes:
            read = await self._read(plan)
            if self._current_store() is not store:  # the owner closed meanwhile
                return encode(ErrorReply("client_detached", "the owner is shutting down"))
            try:
                return self._promoted(session, keys, slots, gens, plan, read)
            finally:
                self._drain_events()

        task = asyncio.get_running_loop().create_task(promote())
        self.promotions.add(task)
        task.add_done_callback(self.promotions.discard)
        return task

    async def _read(self, plan: list[_Planned]) -> list[bool]:
        """Each tier's share of the plan read at once; per planned block, whether it came."""
        rows, out = self.rows, [False] * len(plan)
        parts = [[j for j, item in enumerate(plan) if item[4] is tier] for tier in self.tiers]
        done = await asyncio.gather(*(
            tier.read_many([(plan[j][1], rows[plan[j][2]]) for j in part])
            for tier, part in zip(self.tiers, parts, strict=True) if part))
        for part, read in zip([p for p in parts if p], done, strict=True):
            for j, ok in zip(part, read, strict=True):
                out[j] = ok
        return out

    def _reserve(self, keys: list[BlockKey], missed: list[int]) -> list[_Planned]:
        """Slots for the missed blocks a lower tier holds, as many of the first ones as the
        store has room for (the rest are leased or being written)."""
        found: list[tuple[int, LowerTier]] = []
        for i in missed:
            key = keys[i]
            for tier in self.tiers:
                if tier.contains(key):
                    found.append((i, tier))
                    break
        store = self.store
        found = found[: store.room()]
        if not found:
            return []
        for tier in self.tiers:  # about to be read: kept before the reservation evicts
            tier.touch([keys[i] for i, t in found if t is tier])
        try:
            slots, gens = store.reserve(self.session, [keys[i] for i, _ in found])
        except StoreFullError:  # everything leased or being written: a miss, not an error
            log.info("promotion_skipped", blocks=len(found), reason="store full")
            return []
        return [(i, keys[i], slot, gen, tier)
                for (i, tier), slot, gen in zip(found, slots, gens, strict=True)
                if slot is not None and gen is not None]  # None: another writer puts it

    def _promoted(self, session: SessionId, keys: list[BlockKey], slots: list[int | None],
                  gens: list[int | None], plan: list[_Planned], read: list[bool]) -> bytes:
        """Commit the blocks read (abort the rest), lease them too: the lease's reply."""
        store, own = self.store, self.session
        done = [item for item, ok in zip(plan, read, strict=True) if ok]
        failed = [item for item, ok in zip(plan, read, strict=True) if not ok]
        if failed:
            store.abort(own, [item[2] for item in failed], [item[3] for item in failed])
        if not done:
            return encode(Slots(slots, gens))
        for _, key, _, _, tier in done:  # named in the host tier as it was below
            name = tier.name_of(key)
            if name is not None:
                self.names.learn_one(key[1], name)
        store.commit(own, [item[2] for item in done], [item[3] for item in done])
        promoted = [item[0] for item in done]
        try:
            again, again_gens = store.lease(session, [keys[i] for i in promoted])
        except BlockStoreError as exc:  # the client went away meanwhile
            return encode(ErrorReply(exc.code, str(exc)))
        for i, slot, gen in zip(promoted, again, again_gens, strict=True):
            slots[i], gens[i] = slot, gen
        return encode(Slots(slots, gens))

    def spill(self, evicted: list[tuple[BlockKey, int]], parents: list[int | None]) -> None:
        """The store's eviction hook: hand evicted blocks to the lower tiers. Never raises
        (a failure here would fail the put that evicted them): a block not kept is counted."""
        names = self.names.names_of([key[1] for key, _ in evicted], parents)
        for tier in self.tiers:
            try:
                tier.spill(evicted, names, self.rows)
            except Exception:
                self.num_spill_errors += 1
                log.exception("spill_failed", tier=type(tier).__name__, blocks=len(evicted))
