"""The prefix index: which worker holds how many leading blocks of a request, per tier.

Built from the normalized events of many workers (``kvcore.events``). It is a
pure, synchronous core: no I/O, no asyncio; the gateway feeds it and asks it.

Data layout, per tier: ``holders`` maps a canonical block hash to a bitmask of the workers
holding it (one bit per worker). Per worker and tier we keep the block → parent map and a
count of held children per parent, which is what makes eviction of a parent before its
children visible.

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

import enum
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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

__all__ = ["ApplyOutcome", "IndexStats", "PrefixIndex"]

_NUM_TIERS = len(Tier)
_MISSING: Any = object()


class ApplyOutcome(enum.Enum):
    """What ``PrefixIndex.apply`` did with an event."""

    APPLIED = "applied"
    NEW_EPOCH = "new_epoch"  # the worker restarted: its blocks were cleared, then applied
    GAP = "gap"  # applied, but events were missed before it: the worker needs a resync
    DUPLICATE = "duplicate"  # seq already applied (a replay overlap or out-of-order): dropped
    STALE_EPOCH = "stale_epoch"  # from an epoch older than the worker's current one: dropped


@dataclass(slots=True)
class IndexStats:
    """Counters of everything unusual the index has seen (never reset)."""

    events_applied: int = 0
    events_duplicate: int = 0
    events_stale_epoch: int = 0
    gaps: int = 0
    new_epochs: int = 0
    duplicate_blocks: int = 0  # stored blocks the worker already held
    unknown_removals: int = 0  # removed blocks the worker did not hold
    self_parented_blocks: int = 0  # corrupt: a block named as its own parent (skipped)


@dataclass(slots=True)
class _WorkerTier:
    parents: dict[int, int | None] = field(default_factory=dict)  # held block → its parent
    children: dict[int, int] = field(default_factory=dict)  # parent → held children count
    orphans: int = 0  # held blocks whose parent is set but not held


@dataclass(slots=True)
class _Worker:
    worker_id: str
    bit: int  # 1 << index; the index is also this worker's slot in PrefixIndex._names
    epoch: int = 0
    seq: int = 0
    needs_resync: bool = False
    tiers: list[_WorkerTier] = field(default_factory=lambda: [_WorkerTier() for _ in Tier])


@dataclass(slots=True)
class _TierTable:
    holders: dict[int, int] = field(default_factory=dict)  # block hash → worker bitmask
    dirty: int = 0  # bitmask of workers with orphans in this tier (matched linearly)


class PrefixIndex:
    """Leading-block overlap of a request with every worker's cache, per tier."""

    def __init__(self) -> None:
        self._tables = [_TierTable() for _ in Tier]
        self._workers: dict[str, _Worker] = {}
        self._names: list[str | None] = []  # bit index → worker id (None: free slot)
        self._free_slots: list[int] = []
        self.stats = IndexStats()

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
        get = table.holders.get
        first = get(block_hashes[0], 0)
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
            if self._tables[tier].holders:
                scores = self.match(block_hashes, tier)
                if scores:
                    out[tier] = scores
        return out

    def num_blocks(self, worker_id: str | None = None, tier: Tier | None = None) -> int:
        """Indexed (worker, block) pairs, optionally for one worker and/or one tier."""
        workers = self._workers.values() if worker_id is None else [self._workers[worker_id]]
        tiers = list(Tier) if tier is None else [tier]
        return sum(len(w.tiers[t].parents) for w in workers for t in tiers)

    def orphan_blocks(self) -> int:
        """Held blocks whose parent the same worker no longer holds (prefix-property breaks)."""
        return sum(wt.orphans for w in self._workers.values() for wt in w.tiers)

    def memory_bytes(self) -> int:
        """An estimate of the index's Python heap: dict tables plus the int objects they own."""
        int_bytes = sys.getsizeof(1 << 63)
        # Hash keys are 64-bit ints (one object each); masks of up to 8 workers are cached ints.
        total = sum(sys.getsizeof(t.holders) + len(t.holders) * int_bytes for t in self._tables)
        for worker in self._workers.values():
            for wt in worker.tiers:
                total += sys.getsizeof(wt.parents) + sys.getsizeof(wt.children)
        return total

    # --- snapshots --------------------------------------------------------------------

    def worker_snapshot(self, worker_id: str) -> WorkerSnapshot:
        """Everything one worker holds, at its current (epoch, seq)."""
        worker = self._workers[worker_id]
        tiers = [
            TierBlocks(Tier(t), list(wt.parents), list(wt.parents.values()))
            for t, wt in enumerate(worker.tiers)
            if wt.parents
        ]
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

    # --- internals ----------------------------------------------------------------------

    def _add_worker(self, worker_id: str, first: KVEvent | WorkerSnapshot) -> _Worker:
        if self._free_slots:
            slot = self._free_slots.pop()
            self._names[slot] = worker_id
        else:
            slot = len(self._names)
            self._names.append(worker_id)
        worker = _Worker(worker_id, 1 << slot, epoch=first.epoch)
        self._workers[worker_id] = worker
        return worker

    def _store(
        self, worker: _Worker, tier: int, block_hashes: Sequence[int], parent: int | None
    ) -> None:
        wt = worker.tiers[tier]
        holders = self._tables[tier].holders
        parents, children = wt.parents, wt.children
        bit = worker.bit
        orphans = wt.orphans
        if block_hashes and block_hashes[0] == parent:
            self.stats.self_parented_blocks += 1
            block_hashes = block_hashes[1:]
        for block in block_hashes:
            if block in parents:
                self.stats.duplicate_blocks += 1
                parent = block
                continue
            holders[block] = holders.get(block, 0) | bit
            parents[block] = parent
            if parent is not None:
                children[parent] = children.get(parent, 0) + 1
                if parent not in parents:
                    orphans += 1
            adopted = children.get(block)
            if adopted:
                orphans -= adopted  # children stored before this parent are no longer orphans
            parent = block
        self._set_orphans(wt, tier, bit, orphans)

    def _remove(self, worker: _Worker, tier: int, block_hashes: Sequence[int]) -> None:
        wt = worker.tiers[tier]
        holders = self._tables[tier].holders
        parents, children = wt.parents, wt.children
        clear = ~worker.bit
        orphans = wt.orphans
        missing = _MISSING
        for block in block_hashes:
            parent = parents.pop(block, missing)
            if parent is missing:
                self.stats.unknown_removals += 1
                continue
            mask = holders[block] & clear
            if mask:
                holders[block] = mask
            else:
                del holders[block]
            if parent is not None:
                count = children[parent] - 1
                if count:
                    children[parent] = count
                else:
                    del children[parent]
                if parent not in parents:
                    orphans -= 1
            abandoned = children.get(block)
            if abandoned:
                orphans += abandoned
        self._set_orphans(wt, tier, worker.bit, orphans)

    def _set_orphans(self, wt: _WorkerTier, tier: int, bit: int, orphans: int) -> None:
        if orphans != wt.orphans:
            wt.orphans = orphans
            table = self._tables[tier]
            table.dirty = (table.dirty | bit) if orphans else (table.dirty & ~bit)

    def _clear_tier(self, worker: _Worker, tier: int) -> None:
        wt = worker.tiers[tier]
        holders = self._tables[tier].holders
        clear = ~worker.bit
        for block in wt.parents:
            mask = holders[block] & clear
            if mask:
                holders[block] = mask
            else:
                del holders[block]
        wt.parents.clear()
        wt.children.clear()
        self._set_orphans(wt, tier, worker.bit, 0)

    def _clear_worker(self, worker: _Worker) -> None:
        for tier in range(_NUM_TIERS):
            self._clear_tier(worker, tier)
