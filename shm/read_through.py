"""The host store over the disk tier: evicted blocks spill to disk, and a lease's misses that
the disk holds are promoted back into shared memory before the lease is answered.

The owner (``shm.server``) builds one ``ReadThrough`` when it has a disk tier and hands it
its leases; without one, a lease is the store's alone. Promotion reserves slots for the
blocks the disk holds (as many as the store has room for), reads the files into them
(``DiskTier.read_many`` in a worker thread when the reply may come later, else inline),
commits them (a host ``BlockStored``) and leases them too. The hits are leased first, so
promotion's evictions never take them; a promoted block counts as a miss, then a hit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog

from shm.disk_tier import DiskTier
from shm.errors import BlockStoreError, StoreFullError
from shm.protocol import ErrorReply, Slots, encode
from shm.store import BlockKey, BlockStore, SessionId

__all__ = ["ReadThrough"]

log = structlog.get_logger(component="shm")

# (key, slot, generation) of a block being promoted
_Planned = tuple[BlockKey, int, int]


class ReadThrough:
    """Spill and promotion between one ``BlockStore`` and its ``DiskTier``."""

    def __init__(
        self,
        disk: DiskTier,
        store: BlockStore,
        rows: Any,
        current_store: Callable[[], BlockStore | None],
        drain_events: Callable[[], None],
    ) -> None:
        self.disk = disk
        self.store = store
        self.rows = rows  # (num_slots, block_bytes) uint8 rows of the segment
        self.session = store.open_session()  # the promotions' store session
        self.num_spill_errors = 0
        self.promotions: set[asyncio.Task[bytes]] = set()  # leases reading the disk
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
        """``store.lease``, reading what shared memory misses through the disk tier.

        ``defer``: the reply may come later: the files are then read in a worker thread and
        the reply is the task's result (see ``Connection``); else they are read here.
        """
        store, disk = self.store, self.disk
        slots, gens = store.lease(session, keys)
        if None not in slots:
            return encode(Slots(slots, gens))
        missed = [i for i, slot in enumerate(slots) if slot is None and disk.contains(keys[i])]
        plan = self._reserve([keys[i] for i in missed])
        if not plan:
            return encode(Slots(slots, gens))
        items = [(key, self.rows[slot]) for key, slot, _ in plan]
        if not defer:
            read = [disk.read_into(key, dst) for key, dst in items]
            return self._promoted(session, keys, slots, gens, missed, plan, read)

        async def promote() -> bytes:
            read = await disk.read_many(items)
            if self._current_store() is not store:  # the owner closed meanwhile
                return encode(ErrorReply("client_detached", "the owner is shutting down"))
            try:
                return self._promoted(session, keys, slots, gens, missed, plan, read)
            finally:
                self._drain_events()

        task = asyncio.get_running_loop().create_task(promote())
        self.promotions.add(task)
        task.add_done_callback(self.promotions.discard)
        return task

    def _reserve(self, keys: list[BlockKey]) -> list[_Planned]:
        """Slots for blocks the disk tier holds, as many of the first ones as the store has
        room for (the rest are leased or being written)."""
        store = self.store
        keys = keys[: store.room()]
        if not keys:
            return []
        try:
            slots, gens = store.reserve(self.session, keys)
        except StoreFullError:  # everything leased or being written: a miss, not an error
            log.info("disk_promotion_skipped", blocks=len(keys), reason="store full")
            return []
        return [(key, slot, gen) for key, slot, gen in zip(keys, slots, gens, strict=True)
                if slot is not None and gen is not None]  # None: another writer puts it

    def _promoted(self, session: SessionId, keys: list[BlockKey], slots: list[int | None],
                  gens: list[int | None], missed: list[int], plan: list[_Planned],
                  read: list[bool]) -> bytes:
        """Commit the blocks read (abort the rest), lease them too: the lease's reply."""
        store, own = self.store, self.session
        done = [item for item, ok in zip(plan, read, strict=True) if ok]
        failed = [item for item, ok in zip(plan, read, strict=True) if not ok]
        if failed:
            store.abort(own, [slot for _, slot, _ in failed], [gen for _, _, gen in failed])
        if not done:
            return encode(Slots(slots, gens))
        store.commit(own, [slot for _, slot, _ in done], [gen for _, _, gen in done])
        try:
            again, again_gens = store.lease(session, [keys[i] for i in missed])
        except BlockStoreError as exc:  # the client went away meanwhile
            return encode(ErrorReply(exc.code, str(exc)))
        for i, slot, gen in zip(missed, again, again_gens, strict=True):
            slots[i], gens[i] = slot, gen
        return encode(Slots(slots, gens))

    def spill(self, evicted: list[tuple[BlockKey, int]], parents: list[int | None]) -> None:
        """The store's eviction hook: hand evicted blocks to the disk tier. Never raises
        (a failure here would fail the put that evicted them): a block not kept is counted."""
        try:
            self.disk.spill(evicted, parents, self.rows)
        except Exception:
            self.num_spill_errors += 1
            log.exception("disk_spill_failed", blocks=len(evicted))
