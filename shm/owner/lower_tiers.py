"""The tiers below an owner's host store, as the owner sees them: ``LowerTiers``.

Which can run is a list, ``TIER_FACTORIES``, in read-through order: each factory starts its
tier when the owner's config asks for it (``OwnerConfig.disk_dir``: ``shm.tiers.disk_tier``;
``OwnerConfig.remote_url``: ``shm.tiers.remote_tier``), wires what is its own (the remote
tier's write-through), and says how its statistics join the store's. Wired the same for
every tier: the blocks the store evicts are handed to them before their slots get new
holders, and a lease that misses in shared memory promotes what they hold back into slots
first (``shm.owner.read_through``). So clients see one store, through the same protocol:
``Contains`` and ``Remove`` span the tiers, their events join the store's, their
statistics the store's.

Without lower tiers every call here is the store's alone. They are closed in the order they
started, what is staged written first (the disk tier stays on disk).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np

from kvcore.events import KVEvent
from shm.block_names import BlockNames
from shm.owner.config import OwnerConfig
from shm.owner.read_through import LowerTier, ReadThrough
from shm.owner.store import BlockKey, BlockStore, SessionId, StoreStats
from shm.protocol import Slots, encode
from shm.tiers.disk_tier import DiskTier
from shm.tiers.remote_tier import RemoteTier

__all__ = ["TIER_FACTORIES", "LowerTiers", "StartedTier", "TierFactory", "TierWiring"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TierWiring:
    """What a tier starting below ``store`` gets from its owner: the config, the segment's
    block ``rows`` it reads and fills, the store's block names, and ``drain_events``, to
    call when its events wait."""

    cfg: OwnerConfig
    store: BlockStore
    rows: np.ndarray
    names: BlockNames
    drain_events: Callable[[], None]


@dataclass(frozen=True, slots=True)
class StartedTier:
    """A tier that runs, and how its statistics join the store's."""

    tier: LowerTier
    with_stats: Callable[[StoreStats], StoreStats]


TierFactory = Callable[[TierWiring], Awaitable[StartedTier | None]]


async def start_disk_tier(w: TierWiring) -> StartedTier | None:
    """``--disk-tier-dir``: blocks evicted from the store, kept in a local directory."""
    cfg = w.cfg
    if cfg.disk_dir is None:
        return None
    disk = DiskTier(cfg.disk_dir, cfg.disk_capacity_bytes, cfg.block_bytes,
                    worker_id=cfg.effective_worker_id)
    await disk.start(w.drain_events)

    def with_stats(stats: StoreStats) -> StoreStats:
        d = disk.stats()
        return replace(stats, num_disk_blocks=d.num_blocks, num_disk_writes=d.num_writes,
                       num_disk_reads=d.num_reads, num_disk_corrupt=d.num_corrupt,
                       num_disk_errors=d.num_errors, num_disk_dropped=d.num_dropped)

    return StartedTier(disk, with_stats)


async def start_remote_tier(w: TierWiring) -> StartedTier | None:
    """``--remote-tier-url``: blocks in a Redis-protocol store shared by the replicas; with
    write-through every block the store commits goes there once named."""
    cfg, store, names = w.cfg, w.store, w.names
    if cfg.remote_url is None:
        return None
    remote = RemoteTier(cfg.remote_url, cfg.remote_scope, cfg.block_bytes,
                        worker_id=cfg.effective_worker_id, write=cfg.remote_write)
    await remote.start(w.drain_events, w.rows, store.slots_of)
    if cfg.remote_write == "through":
        store.committed = lambda blocks, parents: remote.committed(
            blocks, names.names_of([key[1] for key, _ in blocks], parents))
        names.listeners.append(remote.named)

    def with_stats(stats: StoreStats) -> StoreStats:
        r = remote.stats()
        return replace(stats, remote_connected=r.connected, num_remote_blocks=r.num_blocks,
                       num_remote_writes=r.num_writes, num_remote_reads=r.num_reads,
                       num_remote_misses=r.num_misses, num_remote_corrupt=r.num_corrupt,
                       num_remote_errors=r.num_errors, num_remote_dropped=r.num_dropped,
                       num_remote_pending=r.num_pending)

    return StartedTier(remote, with_stats)


# The tiers an owner may run below its store, in read-through order (a lease's miss is
# read from the first that holds the block; events and statistics come in this order).
TIER_FACTORIES: tuple[TierFactory, ...] = (start_disk_tier, start_remote_tier)


class LowerTiers:
    """The tiers below one host store, those that run, in ``TIER_FACTORIES``' order."""

    def __init__(self, factories: tuple[TierFactory, ...] = TIER_FACTORIES) -> None:
        self._factories = factories
        self._started: tuple[StartedTier, ...] = ()
        self.tiers: tuple[LowerTier, ...] = ()
        self.through: ReadThrough | None = None  # the host store over the tiers

    def of(self, kind: type[T]) -> T | None:
        """The running tier of class ``kind`` (``DiskTier``, ``RemoteTier``), if any."""
        return next((tier for tier in self.tiers if isinstance(tier, kind)), None)

    async def start(self, cfg: OwnerConfig, store: BlockStore, rows: np.ndarray,
                    names: BlockNames, drain_events: Callable[[], None],
                    current_store: Callable[[], BlockStore | None]) -> None:
        """Start the tiers ``cfg`` asks for and wire them to ``store``, whose segment's
        block ``rows`` they read and fill. ``drain_events``: called when their events wait;
        ``current_store``: the owner's store now (None once it closed). A tier that fails
        to start leaves those before it here, for ``aclose``."""
        wiring = TierWiring(cfg, store, rows, names, drain_events)
        for factory in self._factories:
            started = await factory(wiring)
            if started is not None:
                self._started += (started,)
                self.tiers += (started.tier,)
        if self.tiers:
            self.through = ReadThrough(self.tiers, store, rows, current_store, drain_events,
                                       names)

    async def finish_reads(self) -> None:
        """Wait for the promotions in flight: their reads fill slots of the segment."""
        if self.through is not None:
            await self.through.finish()

    async def aclose(self) -> None:
        """What is staged is written (the disk tier stays on disk), then they stop."""
        tiers, self.tiers, self._started = self.tiers, (), ()
        for tier in tiers:
            await tier.aclose()

    def forget_store(self) -> None:
        """The store closed: promote nothing into it any more."""
        self.through = None

    # ------------------------------------------------------------ the store's requests
    def lease(self, store: BlockStore, session: SessionId, keys: list[BlockKey],
              defer: bool) -> bytes | asyncio.Task[bytes]:
        """``Lease``: what shared memory misses is read from below (``ReadThrough.lease``)."""
        if self.through is not None:
            return self.through.lease(session, keys, defer)
        return encode(Slots(*store.lease(session, keys)))

    def contains(self, store: BlockStore, keys: list[BlockKey]) -> list[bool]:
        """``Contains``: per key, whether the store or a tier below it holds it."""
        held = store.contains(keys)
        for tier in self.tiers:
            held = [h or tier.contains(k) for h, k in zip(held, keys, strict=True)]
        return held

    def remove(self, store: BlockStore, keys: list[BlockKey]) -> list[bool]:
        """``Remove``: from the store and every tier; per key, whether one held it."""
        removed = store.remove(keys)
        for tier in self.tiers:
            removed = [a or b for a, b in zip(removed, tier.remove(keys), strict=True)]
        return removed

    def take_events(self) -> list[KVEvent]:
        """The tiers' events (``disk``, ``remote``: their own ``Tier``), in tier order."""
        events: list[KVEvent] = []
        for tier in self.tiers:
            events += tier.take_events()
        return events

    def with_stats(self, stats: StoreStats) -> StoreStats:
        """The store's statistics with the tiers' own."""
        for started in self._started:
            stats = started.with_stats(stats)
        return stats
