"""The prefix index: which worker holds how many leading blocks of a request, per tier.

Built from the normalized events of many workers (``kvcore.events``). It is a
pure, synchronous core: no I/O, no asyncio; the gateway feeds it and asks it.

Data layout: per worker and tier one ``WorkerBlocks`` (``worker_blocks.py``): a dict block →
parent, as that worker reported it, plus its leaves, branch counts and lost parents. Per tier
one ``heads`` dict maps every root block to the mask of the workers holding it: the holders of
a request's block 0 in one lookup.

Why matching is not a walk over every block: block hashes are chained, so a worker that holds
block ``i`` of a request stored blocks ``0..i-1`` with it. As long as it has not since lost
one of those ancestors ("orphans": held blocks whose parent it no longer holds), each
worker's depth is found by binary search over its own dict: O(log n) lookups instead of O(n).
The index counts orphans exactly per worker and tier; a worker with any orphan is matched by
a linear scan instead, and a block 0 that is no worker's root is looked up in every worker,
so answers are always exact (the property tests compare with brute force) and
``stats.orphan_blocks`` reports how often engines violate the prefix property.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvcore.events import (
    BlockRemoved,
    BlockStored,
    IndexSnapshot,
    KVEvent,
    Tier,
    TierBlocks,
    WorkerSnapshot,
)
from kvcore.wire import WireError, decode, encode
from routing.placement.index_image import (
    IMAGE_VERSION,
    IndexImage,
    pack_worker,
    unpack_workers,
)
from routing.placement.index_stats import ApplyOutcome, IndexStats
from routing.placement.worker_blocks import WorkerBlocks

__all__ = ["ApplyOutcome", "IndexObserver", "IndexStats", "PrefixIndex"]

_NUM_TIERS = len(Tier)


@dataclass(slots=True)
class _Worker:
    worker_id: str
    bit: int  # 1 << slot; the slot is this worker's place in PrefixIndex._names
    epoch: int = 0
    seq: int = 0
    needs_resync: bool = False
    tiers: list[WorkerBlocks] = field(default_factory=list)


class IndexObserver(Protocol):
    """Told what the index holds as it changes (the indexer API's XXH3 translation table:
    ``routing.indexer.rolling_hashes``); None, the default, costs one test per event."""

    def applied(self, event: KVEvent) -> None:
        """An event was applied (never a duplicate or a stale one)."""

    def worker_reset(self, worker_id: str, snapshot: WorkerSnapshot | None) -> None:
        """The worker's blocks were replaced: by ``snapshot``, or by nothing."""


class PrefixIndex:
    """Leading-block overlap of a request with every worker's cache, per tier."""

    def __init__(self) -> None:
        self.stats = IndexStats()
        self.observer: IndexObserver | None = None
        self._workers: dict[str, _Worker] = {}
        self._names: list[str | None] = []  # slot → worker id (None: free slot)
        self._free_slots: list[int] = []
        self._slots: list[list[WorkerBlocks]] = [[] for _ in Tier]  # tier → slot → blocks
        self._heads: list[dict[int, int]] = [{} for _ in Tier]  # root block → holders mask
        self._dirty = [0] * _NUM_TIERS  # per tier: the mask of workers with orphans
        self._holding = [0] * _NUM_TIERS  # per tier: the mask of workers with any block

    # --- events -----------------------------------------------------------------------

    def apply(self, event: KVEvent) -> ApplyOutcome:
        """Apply one event of a worker's sequenced stream."""
        worker = self._workers.get(event.worker_id) or self._add_worker(event.worker_id, event)
        outcome = ApplyOutcome.APPLIED
        if event.epoch != worker.epoch:
            if event.epoch < worker.epoch:
                self.stats.events_stale_epoch += 1
                return ApplyOutcome.STALE_EPOCH
            self._clear_worker(worker)
            worker.epoch, worker.seq = event.epoch, 0
            self.stats.new_epochs += 1
            if self.observer is not None:
                self.observer.worker_reset(worker.worker_id, None)
            outcome = ApplyOutcome.NEW_EPOCH
        seq = event.seq
        if seq <= worker.seq:
            self.stats.events_duplicate += 1
            return ApplyOutcome.DUPLICATE
        if seq != worker.seq + 1:
            self.stats.gaps += 1
            worker.needs_resync = True
            outcome = ApplyOutcome.GAP
        worker.seq = seq
        kind = type(event)
        if kind is BlockStored:
            self._store(worker, event.tier, event.block_hashes, event.parent_hash)  # type: ignore[union-attr]
        elif kind is BlockRemoved:
            self._remove(worker, event.tier, event.block_hashes)  # type: ignore[union-attr]
        else:
            self._clear_tier(worker, event.tier)
        self.stats.events_applied += 1
        if self.observer is not None:
            self.observer.applied(event)
        return outcome

    def remove_worker(self, worker_id: str) -> bool:
        """Forget a worker and every block it held; False if it was unknown."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return False
        self._clear_worker(worker)
        slot = worker.bit.bit_length() - 1
        self._names[slot] = None
        self._free_slots.append(slot)
        if self.observer is not None:
            self.observer.worker_reset(worker_id, None)
        return True

    def needs_resync(self, worker_id: str) -> bool:
        """True after a gap in the worker's stream, until a snapshot of it is loaded."""
        worker = self._workers.get(worker_id)
        return worker is not None and worker.needs_resync

    def position(self, worker_id: str) -> tuple[int, int] | None:
        """(epoch, seq) of the last event applied for the worker, or None if unknown."""
        worker = self._workers.get(worker_id)
        return None if worker is None else (worker.epoch, worker.seq)

    @property
    def worker_ids(self) -> list[str]:
        return list(self._workers)

    # --- queries ----------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int], tier: Tier = Tier.GPU) -> dict[str, int]:
        """For every worker holding block 0: how many leading blocks it holds in ``tier``."""
        if not block_hashes:
            return {}
        slots = self._slots[tier]
        h0 = block_hashes[0]
        first = self._heads[tier].get(h0)
        if first is None:  # no worker's root: look in every worker (exact, and rare)
            first = 0
            holding = self._holding[tier]
            while holding:
                low = holding & -holding
                holding ^= low
                if h0 in slots[low.bit_length() - 1].par:
                    first |= low
            if not first:
                return {}
        names = self._names
        dirty = self._dirty[tier]
        n = len(block_hashes)
        last = block_hashes[n - 1]
        result: dict[str, int] = {}
        depth = 0
        while first:
            low = first & -first
            first ^= low
            slot = low.bit_length() - 1
            par = slots[slot].par
            if low & dirty:  # it lost an ancestor somewhere: walk
                depth = 1
                while depth < n and block_hashes[depth] in par:
                    depth += 1
            elif last in par:
                depth = n
            else:
                lo, hi = 0, n - 1  # it holds block lo, not block hi
                if 0 < depth < hi:  # workers sharing a prefix stop at the same depth: try
                    if block_hashes[depth] in par:  # the last one's first (two lookups)
                        lo = depth
                    else:
                        hi = depth
                        if block_hashes[depth - 1] in par:
                            lo = depth - 1
                        else:
                            hi = depth - 1
                while hi - lo > 1:
                    mid = (lo + hi) >> 1
                    if block_hashes[mid] in par:
                        lo = mid
                    else:
                        hi = mid
                depth = hi
            result[names[slot]] = depth  # type: ignore[index]
        return result

    def match_tiers(self, block_hashes: Sequence[int]) -> dict[Tier, dict[str, int]]:
        """``match`` for every tier that has any block; tiers with no holder are left out."""
        out: dict[Tier, dict[str, int]] = {}
        for tier in Tier:
            if self._holding[tier]:
                scores = self.match(block_hashes, tier)
                if scores:
                    out[tier] = scores
        return out

    def held_depth(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """How many leading blocks the worker holds in some tier, each block in whichever
        tier it is (block 0 on the GPU and block 1 on the host count as two): a walk, for
        queries (the indexer API), not for placement's hot path."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return 0
        held = [b.par for b in worker.tiers if b.blocks]
        depth = 0
        for block in block_hashes:
            if not any(block in par for par in held):
                break
            depth += 1
        return depth

    def num_blocks(self, worker_id: str | None = None, tier: Tier | None = None) -> int:
        """Indexed (worker, block) pairs, optionally for one worker and/or one tier."""
        workers = self._workers.values() if worker_id is None else [self._workers[worker_id]]
        tiers = list(Tier) if tier is None else [tier]
        return sum(w.tiers[t].blocks for w in workers for t in tiers)

    def orphan_blocks(self) -> int:
        """Held blocks whose parent the same worker no longer holds (prefix-property breaks)."""
        return sum(b.orphans for w in self._workers.values() for b in w.tiers)

    def memory_bytes(self) -> int:
        """An estimate of the index's Python heap held for blocks: the dicts and sets of
        every worker's non-empty tiers plus their key ints (a value is its parent's key
        object: nothing of its own), and the heads."""
        int_bytes = sys.getsizeof(1 << 63)  # a 64-bit hash key
        size = sys.getsizeof
        total = sum(size(h) + len(h) * int_bytes for h in self._heads)
        for w in self._workers.values():
            for b in w.tiers:
                if b.blocks:
                    total += (size(b.par) + len(b.par) * int_bytes + size(b.leaves)
                              + size(b.multi) + size(b.lost))
        return total

    # --- snapshots --------------------------------------------------------------------

    def worker_snapshot(self, worker_id: str) -> WorkerSnapshot:
        """Everything one worker holds, at its current (epoch, seq)."""
        worker = self._workers[worker_id]
        tiers = []
        for t, held in enumerate(worker.tiers):
            if held.blocks:
                par = held.par
                tiers.append(TierBlocks(Tier(t), list(par),
                                        [None if p == b else p for b, p in par.items()]))
        return WorkerSnapshot(worker.worker_id, worker.epoch, worker.seq, tiers)

    def load_worker_snapshot(self, snapshot: WorkerSnapshot) -> None:
        """Replace one worker's state with a snapshot (a resync); clears its resync flag."""
        worker = self._workers.get(snapshot.worker_id) or self._add_worker(
            snapshot.worker_id, snapshot
        )
        self._clear_worker(worker)
        worker.epoch, worker.seq, worker.needs_resync = snapshot.epoch, snapshot.seq, False
        for tier_blocks in snapshot.tiers:
            for block, parent in zip(
                tier_blocks.block_hashes, tier_blocks.parent_hashes, strict=True
            ):
                self._store(worker, tier_blocks.tier, (block,), parent)
        if self.observer is not None:
            self.observer.worker_reset(snapshot.worker_id, snapshot)

    def snapshot(self) -> IndexSnapshot:
        return IndexSnapshot(
            [self.worker_snapshot(w) for w in self._workers],
            [w.worker_id for w in self._workers.values() if w.needs_resync],
        )

    def to_bytes(self) -> bytes:
        """The whole index as one wire frame (``kvcore.wire``)."""
        return encode(self.snapshot())

    @classmethod
    def from_bytes(cls, frame: bytes) -> PrefixIndex:
        """An index restored from ``to_bytes``; raises ``WireError`` on anything else."""
        message = decode(frame)
        if not isinstance(message, IndexSnapshot):
            raise WireError(f"expected an index snapshot, got {type(message).__name__}")
        index = cls()
        for worker_snapshot in message.workers:
            index.load_worker_snapshot(worker_snapshot)
        for worker_id in message.needs_resync:
            if worker_id in index._workers:
                index._workers[worker_id].needs_resync = True
        return index

    def copy(self) -> PrefixIndex:
        """An independent copy, cheap next to ``to_image``: what a snapshot packs off the
        event loop while this one goes on changing."""
        other = PrefixIndex()
        for worker_id, w in self._workers.items():
            other._workers[worker_id] = _Worker(w.worker_id, w.bit, w.epoch, w.seq,
                                                w.needs_resync, [b.copy() for b in w.tiers])
        other._names, other._free_slots = list(self._names), list(self._free_slots)
        other._heads = [h.copy() for h in self._heads]
        other._dirty, other._holding = list(self._dirty), list(self._holding)
        other._index_slots()
        return other

    def to_image(self) -> IndexImage:
        """The whole index as each worker's own arrays (``index_image.py``): what a
        restarting gateway loads in a fraction of the time ``snapshot()`` takes to replay."""
        return IndexImage(IMAGE_VERSION, [
            pack_worker(w.worker_id, w.bit.bit_length() - 1, w.epoch, w.seq, w.needs_resync,
                        [b.par for b in w.tiers])
            for w in self._workers.values()
        ])

    def load_image(self, image: IndexImage) -> None:
        """Replace the whole index with an image's; on ``WireError`` it is left as it was."""
        loaded = unpack_workers(image, _NUM_TIERS)
        if self.observer is not None:  # an image has no tokens: nothing to translate
            for worker_id in self._workers:
                self.observer.worker_reset(worker_id, None)
        workers: dict[str, _Worker] = {}
        heads: list[dict[int, int]] = [{} for _ in Tier]
        names: list[str | None] = [None] * (max((w.slot for w in image.workers), default=-1) + 1)
        for w, tiers in zip(image.workers, loaded, strict=True):
            bit = 1 << w.slot
            held = []
            for t, (par, roots) in enumerate(tiers):
                blocks = WorkerBlocks(bit)
                blocks.adopt(par, roots)
                h = heads[t]
                for root in roots:
                    h[root] = h.get(root, 0) | bit
                held.append(blocks)
            workers[w.worker_id] = _Worker(w.worker_id, bit, w.epoch, w.seq, w.needs_resync,
                                           held)
            names[w.slot] = w.worker_id
        for t, h in enumerate(heads):  # a root of one worker may be held below a root by others
            for worker in workers.values():
                par, bit = worker.tiers[t].par, worker.bit
                for root in h.keys() & par.keys() if len(h) < len(par) else par:
                    mask = h.get(root)
                    if mask is not None:
                        h[root] = mask | bit
        self._workers, self._names, self._heads = workers, names, heads
        self._free_slots = [slot for slot, name in enumerate(names) if name is None]
        self._dirty = [sum(w.bit for w in workers.values() if w.tiers[t].orphans)
                       for t in range(_NUM_TIERS)]
        self._holding = [sum(w.bit for w in workers.values() if w.tiers[t].blocks)
                         for t in range(_NUM_TIERS)]
        self._index_slots()

    # --- internals ----------------------------------------------------------------------

    def _index_slots(self) -> None:
        """Rebuild the tier → slot → ``WorkerBlocks`` lists from the workers (free slots: an
        empty, never written ``WorkerBlocks``)."""
        width = len(self._names)
        self._slots = [[WorkerBlocks(1 << s) for s in range(width)] for _ in Tier]
        for w in self._workers.values():
            slot = w.bit.bit_length() - 1
            for t, blocks in enumerate(w.tiers):
                self._slots[t][slot] = blocks

    def _add_worker(self, worker_id: str, first: KVEvent | WorkerSnapshot) -> _Worker:
        if self._free_slots:
            slot = self._free_slots.pop()
            self._names[slot] = worker_id
        else:
            slot = len(self._names)
            self._names.append(worker_id)
        bit = 1 << slot
        worker = _Worker(worker_id, bit, epoch=first.epoch,
                         tiers=[WorkerBlocks(bit) for _ in Tier])
        for t, blocks in enumerate(worker.tiers):
            slots = self._slots[t]
            if slot < len(slots):
                slots[slot] = blocks
            else:
                slots.append(blocks)
        self._workers[worker_id] = worker
        return worker

    def _store(
        self, worker: _Worker, tier: int, block_hashes: Sequence[int], parent: int | None
    ) -> None:
        if block_hashes and block_hashes[0] == parent:
            self.stats.self_parented_blocks += 1
            block_hashes = block_hashes[1:]
        held = worker.tiers[tier]
        had = held.orphans
        heads = self._heads[tier]
        new_head = held.store(block_hashes, parent, heads, self.stats)
        if new_head is not None:  # other workers may hold it below a root of theirs
            mask = heads[new_head]
            for other in self._slots[tier]:
                if new_head in other.par:
                    mask |= other.bit
            heads[new_head] = mask
        if held.blocks:
            self._holding[tier] |= worker.bit
        if (held.orphans == 0) != (had == 0):
            self._set_dirty(tier, worker.bit, held.orphans)

    def _remove(self, worker: _Worker, tier: int, block_hashes: Sequence[int]) -> None:
        held = worker.tiers[tier]
        had = held.orphans
        held.remove(block_hashes, self._heads[tier], self.stats)
        if not held.blocks:
            self._holding[tier] &= ~worker.bit
        if (held.orphans == 0) != (had == 0):
            self._set_dirty(tier, worker.bit, held.orphans)

    def _set_dirty(self, tier: int, bit: int, orphans: int) -> None:
        dirty = self._dirty[tier]
        self._dirty[tier] = (dirty | bit) if orphans else (dirty & ~bit)

    def _clear_tier(self, worker: _Worker, tier: int) -> None:
        held = worker.tiers[tier]
        had = held.orphans
        held.clear(self._heads[tier])
        self._holding[tier] &= ~worker.bit
        if had:
            self._set_dirty(tier, worker.bit, 0)

    def _clear_worker(self, worker: _Worker) -> None:
        for tier in range(_NUM_TIERS):
            self._clear_tier(worker, tier)
