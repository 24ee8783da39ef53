"""The prefix index: which worker holds how many leading blocks of a request, per tier.

Built from the normalized events of many workers (``kvcore.events``). It is a
pure, synchronous core: no I/O, no asyncio; the gateway feeds it and asks it.

Data layout, per tier: one ``BlockTable`` (``block_table.py``) maps each block hash to one
packed int: the workers holding it, the workers holding a child of it, and its parent. Per
worker and tier only two counters remain (blocks held, orphans), so a block costs one dict
entry however many workers hold it.

Why matching is not a walk over every block: block hashes are chained, so a worker that holds
block ``i`` of a request stored blocks ``0..i-1`` with it. As long as it has not since lost
one of those ancestors ("orphans": held blocks whose parent it no longer holds), the set of
workers holding block ``i`` shrinks monotonically with ``i``, and each worker's depth is
found by binary search: O(distinct depths × log n) lookups instead of O(n). The index counts
orphans exactly per worker and tier; a worker with any orphan is matched by a linear scan
instead, so answers are always exact (the property tests compare with brute force) and
``stats.orphan_blocks`` reports how often engines violate the prefix property.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

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
from routing.placement.block_table import BlockTable, Held
from routing.placement.index_image import (
    IMAGE_VERSION,
    IndexImage,
    WorkerImage,
    pack_tables,
    unpack_tables,
)
from routing.placement.index_stats import ApplyOutcome, IndexStats

__all__ = ["ApplyOutcome", "IndexStats", "PrefixIndex"]

_NUM_TIERS = len(Tier)


@dataclass(slots=True)
class _Worker:
    worker_id: str
    bit: int  # 1 << index; the index is also this worker's slot in PrefixIndex._names
    epoch: int = 0
    seq: int = 0
    needs_resync: bool = False
    tiers: list[Held] = field(default_factory=lambda: [Held() for _ in Tier])


class PrefixIndex:
    """Leading-block overlap of a request with every worker's cache, per tier."""

    def __init__(self) -> None:
        self.stats = IndexStats()
        self._tables = [BlockTable(self.stats) for _ in Tier]
        self._workers: dict[str, _Worker] = {}
        self._names: list[str | None] = []  # bit index → worker id (None: free slot)
        self._free_slots: list[int] = []

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
        table = self._tables[tier]
        get = table.nodes.get
        first = get(block_hashes[0], 0) & table.holders  # the holders bits only
        if not first:
            return {}
        names = self._names
        result: dict[str, int] = {}
        n = len(block_hashes)
        last = block_hashes[n - 1]
        dirty = first & table.dirty
        cur = first ^ dirty
        lo = 0  # invariant: every worker in `cur` holds blocks 0..lo
        while cur:
            if get(last, 0) & cur == cur:
                depth, gone, cur = n, cur, 0
            else:
                hi = n - 1  # not every worker in `cur` holds block hi
                while hi - lo > 1:
                    mid = (lo + hi) >> 1
                    if get(block_hashes[mid], 0) & cur == cur:
                        lo = mid
                    else:
                        hi = mid
                nxt = get(block_hashes[hi], 0) & cur
                depth, gone, cur, lo = hi, cur ^ nxt, nxt, hi
            while gone:
                low = gone & -gone
                result[names[low.bit_length() - 1]] = depth  # type: ignore[index]
                gone ^= low
        while dirty:
            low = dirty & -dirty
            depth = 1
            while depth < n and get(block_hashes[depth], 0) & low:
                depth += 1
            result[names[low.bit_length() - 1]] = depth  # type: ignore[index]
            dirty ^= low
        return result

    def match_tiers(self, block_hashes: Sequence[int]) -> dict[Tier, dict[str, int]]:
        """``match`` for every tier that has any block; tiers with no holder are left out."""
        out: dict[Tier, dict[str, int]] = {}
        for tier in Tier:
            if self._tables[tier].nodes:
                scores = self.match(block_hashes, tier)
                if scores:
                    out[tier] = scores
        return out

    def num_blocks(self, worker_id: str | None = None, tier: Tier | None = None) -> int:
        """Indexed (worker, block) pairs, optionally for one worker and/or one tier."""
        workers = self._workers.values() if worker_id is None else [self._workers[worker_id]]
        tiers = list(Tier) if tier is None else [tier]
        return sum(w.tiers[t].blocks for w in workers for t in tiers)

    def orphan_blocks(self) -> int:
        """Held blocks whose parent the same worker no longer holds (prefix-property breaks)."""
        return sum(wt.orphans for w in self._workers.values() for wt in w.tiers)

    def memory_bytes(self) -> int:
        """An estimate of the index's Python heap: the tables plus the int objects they own."""
        int_bytes = sys.getsizeof(1 << 63)  # a 64-bit hash key; a packed value is as large
        return sum(
            sys.getsizeof(t.nodes) + len(t.nodes) * 2 * int_bytes + sys.getsizeof(t.multi)
            for t in self._tables
        )

    # --- snapshots --------------------------------------------------------------------

    def worker_snapshot(self, worker_id: str) -> WorkerSnapshot:
        """Everything one worker holds, at its current (epoch, seq)."""
        worker = self._workers[worker_id]
        tiers = []
        for t, held in enumerate(worker.tiers):
            if held.blocks:
                table = self._tables[t]
                blocks = table.blocks_of(worker.bit)
                tiers.append(TierBlocks(Tier(t), blocks, list(table.parents(blocks))))
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
        other._tables = [t.copy(other.stats) for t in self._tables]
        for worker_id, w in self._workers.items():
            other._workers[worker_id] = _Worker(w.worker_id, w.bit, w.epoch, w.seq,
                                                w.needs_resync,
                                                [Held(h.blocks, h.orphans) for h in w.tiers])
        other._names, other._free_slots = list(self._names), list(self._free_slots)
        return other

    def to_image(self) -> IndexImage:
        """The whole index as its tables' own arrays (``index_image.py``): what a restarting
        gateway loads in a fraction of the time ``snapshot()`` takes to replay."""
        workers = [
            WorkerImage(w.worker_id, w.bit.bit_length() - 1, w.epoch, w.seq, w.needs_resync,
                        [h.blocks for h in w.tiers], [h.orphans for h in w.tiers])
            for w in self._workers.values()
        ]
        return IndexImage(IMAGE_VERSION, self._tables[0].width, workers, pack_tables(self._tables))

    def load_image(self, image: IndexImage) -> None:
        """Replace the whole index with an image's; on ``WireError`` it is left as it was."""
        self._tables = unpack_tables(image, self.stats)
        self._workers = {}
        self._names = [None] * (max((w.slot for w in image.workers), default=-1) + 1)
        for w in image.workers:
            held = [Held(b, o) for b, o in zip(w.blocks, w.orphans, strict=True)]
            self._workers[w.worker_id] = _Worker(w.worker_id, 1 << w.slot, w.epoch, w.seq,
                                                 w.needs_resync, held)
            self._names[w.slot] = w.worker_id
        self._free_slots = [slot for slot, name in enumerate(self._names) if name is None]

    # --- internals ----------------------------------------------------------------------

    def _add_worker(self, worker_id: str, first: KVEvent | WorkerSnapshot) -> _Worker:
        if self._free_slots:
            slot = self._free_slots.pop()
            self._names[slot] = worker_id
        else:
            slot = len(self._names)
            self._names.append(worker_id)
        width = self._tables[0].width
        if slot >= width:
            while slot >= width:
                width *= 2
            for table in self._tables:
                table.widen(width)
        worker = _Worker(worker_id, 1 << slot, epoch=first.epoch)
        self._workers[worker_id] = worker
        return worker

    def _store(
        self, worker: _Worker, tier: int, block_hashes: Sequence[int], parent: int | None
    ) -> None:
        if block_hashes and block_hashes[0] == parent:
            self.stats.self_parented_blocks += 1
            block_hashes = block_hashes[1:]
        held = worker.tiers[tier]
        orphans = self._tables[tier].store(held, worker.bit, block_hashes, parent)
        if orphans != held.orphans:
            self._set_orphans(held, tier, worker.bit, orphans)

    def _remove(self, worker: _Worker, tier: int, block_hashes: Sequence[int]) -> None:
        held = worker.tiers[tier]
        orphans = self._tables[tier].remove(held, worker.bit, block_hashes)
        if orphans != held.orphans:
            self._set_orphans(held, tier, worker.bit, orphans)

    def _set_orphans(self, held: Held, tier: int, bit: int, orphans: int) -> None:
        held.orphans = orphans
        table = self._tables[tier]
        table.dirty = (table.dirty | bit) if orphans else (table.dirty & ~bit)

    def _clear_tier(self, worker: _Worker, tier: int) -> None:
        held = worker.tiers[tier]
        if held.blocks:
            blocks = self._tables[tier].blocks_of(worker.bit)
            blocks.reverse()  # children first: nothing is orphaned on the way
            self._remove(worker, tier, blocks)

    def _clear_worker(self, worker: _Worker) -> None:
        for tier in range(_NUM_TIERS):
            self._clear_tier(worker, tier)
