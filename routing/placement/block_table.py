"""One tier of the prefix index: every indexed block in a single dict, packed into one int.

Why one dict: a Python dict entry costs ~40–90 bytes and an int object 28–36, so the earlier
layout (a holders dict plus, per worker, a parent dict and a child-count dict: three entries per
block) cost ~224 bytes per block. Here ``nodes`` maps a block hash to one int::

    bits [0, w)    holders: one bit per worker slot (``w`` = ``width``)
    bits [w, 2w)   child holders: workers holding at least one child of this block
    bits [2w, ..)  the parent's hash, or the block's own hash for a root (no block is its
                   own parent: such events are rejected), so no flag bit is needed

The parent is a property of the chained hash, so it is kept once for every worker; the first
report wins and a disagreeing one is counted (``parent_conflicts``), never half-applied. A
worker holding two or more children of one block (a branch point) keeps the exact count in
``multi``, which stays small. A block nobody holds keeps its entry while some worker still
holds a child of it (an orphan), so that storing it again adopts those children. Matching
reads ``nodes.get(h, 0) & holders``: the higher bits never intersect a holders mask.

Chains are the common case: a stored run writes each fresh block once, already marked as
holding its child, and a leaf-first removal reads and writes each parent once. A dict never
shrinks on delete, and after churn it regrows to 3× its live entries; ``store`` then rebuilds
it at its compact size when that leaves room to grow (amortized over the inserts).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from routing.placement.index_stats import IndexStats

__all__ = ["BlockTable", "Held"]

_HEADROOM = 1.25  # rebuild only if the compact dict then has room for 25% more entries


@dataclass(slots=True)
class Held:
    """One worker's standing in one tier: blocks it holds, and how many lost their parent."""

    blocks: int = 0
    orphans: int = 0


class BlockTable:
    """Block hash → packed (holders, child holders, parent), for one tier of every worker."""

    __slots__ = ("_cap", "dirty", "holders", "keep", "multi", "nodes", "stats", "width")

    def __init__(self, stats: IndexStats, width: int = 8) -> None:
        self.nodes: dict[int, int] = {}
        self.multi: dict[int, dict[int, int]] = {}  # block → {worker bit: held children ≥ 2}
        self.dirty = 0  # bitmask of workers with orphans in this tier (matched linearly)
        self.stats = stats
        self._set_width(width)
        self._cap = sys.getsizeof(self.nodes)

    def store(self, held: Held, bit: int, blocks: Sequence[int], parent: int | None) -> int:
        """Add ``blocks`` (a chain under ``parent``) for the worker ``bit``; returns its orphans."""
        nodes = self.nodes
        get = nodes.get
        width = self.width
        shift = width << 1
        cbit = bit << width
        head = bit | cbit  # a fresh block's bits, assuming its child comes next
        live = self.holders
        orphans, count = held.orphans, held.blocks
        pending = None  # the block just added, not yet written: the next one's parent
        pending_value = 0  # its value, with the child bit already set
        for block in blocks:
            v = get(block)
            if pending is not None:
                if v is None and block != pending:
                    nodes[pending] = pending_value  # the common case: one write per block
                    pending, pending_value = block, head | (pending << shift)
                    count += 1
                    parent = block
                    continue
                nodes[pending] = pending_value ^ cbit
                pending = None
                if v is None:
                    v = get(block)  # a repeat of the block just written
            if v is not None:
                if v & bit:
                    self.stats.duplicate_blocks += 1
                    parent = block
                    continue
                if v & live:  # held by others: its parent is already known
                    known: int | None = v >> shift
                    if known == block:
                        known = None
                    if known != parent:
                        self.stats.parent_conflicts += 1
                        parent = known
            if parent is not None:
                pv = get(parent)
                if pv is None:
                    nodes[parent] = cbit  # a placeholder: only knows a child is held
                    orphans += 1
                else:
                    if pv & cbit:
                        self._add_child(parent, bit)
                    else:
                        nodes[parent] = pv | cbit
                    if not pv & bit:
                        orphans += 1
                value = parent << shift
            else:
                value = block << shift  # a root
            if v is None:
                pending, pending_value = block, head | value
            else:
                if v & cbit:
                    orphans -= self.children(block, bit)  # stored after its children: adopted
                nodes[block] = (v | bit) if v & live else (v & self.keep) | bit | value
            count += 1
            parent = block
        if pending is not None:
            nodes[pending] = pending_value ^ cbit
        held.blocks = count
        if nodes.__sizeof__() > self._cap:
            self._compact()
        return orphans

    def remove(self, held: Held, bit: int, blocks: Sequence[int]) -> int:
        """Drop ``blocks`` of the worker ``bit``; returns its orphans."""
        nodes = self.nodes
        get = nodes.get
        multi = self.multi
        width = self.width
        shift = width << 1
        cbit = bit << width
        keep = self.keep
        orphans, count = held.orphans, held.blocks
        pending = None  # the last block's parent, its new value not yet written: in a chain
        pending_value = 0  # removed leaf-first it is the next block, read and written once
        for block in blocks:
            if pending is not None and block == pending:
                v = pending_value
                pending = None
            else:
                if pending is not None:
                    if pending_value & keep:
                        nodes[pending] = pending_value
                    else:
                        del nodes[pending]
                    pending = None
                found = get(block)
                if found is None:
                    self.stats.unknown_removals += 1
                    continue
                v = found
            if not v & bit:
                self.stats.unknown_removals += 1
                if v & keep:
                    nodes[block] = v
                else:
                    del nodes[block]
                continue
            count -= 1
            if v & cbit:
                orphans += self.children(block, bit)  # its held children lose their parent
            parent = v >> shift
            if parent != block:
                pv = nodes[parent]
                if not pv & bit:
                    orphans -= 1  # it was an orphan itself
                counts = multi.get(parent) if multi else None
                if counts is not None and bit in counts:
                    self._drop_child(parent, bit, counts)
                else:
                    pending, pending_value = parent, pv ^ cbit
            v ^= bit
            if v & keep:
                nodes[block] = v
            else:
                del nodes[block]
        if pending is not None:
            if pending_value & keep:
                nodes[pending] = pending_value
            else:
                del nodes[pending]
        held.blocks = count
        return orphans

    def children(self, block: int, bit: int) -> int:
        """How many children of ``block`` the worker ``bit`` holds, given it holds one."""
        counts = self.multi.get(block)
        return counts.get(bit, 1) if counts else 1

    def blocks_of(self, bit: int) -> list[int]:
        """The worker's blocks, parents before children (the dict keeps insertion order)."""
        return [block for block, v in self.nodes.items() if v & bit]

    def parents(self, blocks: Sequence[int]) -> Iterator[int | None]:
        shift, nodes = self.width << 1, self.nodes
        for block in blocks:
            parent = nodes[block] >> shift
            yield None if parent == block else parent

    def copy(self, stats: IndexStats) -> BlockTable:
        """An independent copy (``dict.copy`` of a compact dict is one memcpy)."""
        table = BlockTable(stats, self.width)
        table.adopt(self.nodes.copy(), {b: dict(c) for b, c in self.multi.items()}, self.dirty)
        return table

    def adopt(self, nodes: dict[int, int], multi: dict[int, dict[int, int]], dirty: int) -> None:
        """Take over entries packed for this table's width (a loaded ``IndexImage``)."""
        self.nodes, self.multi, self.dirty = nodes, multi, dirty
        self._cap = sys.getsizeof(nodes)

    def widen(self, width: int) -> None:
        """Repack every entry for ``width`` worker slots (when a slot past the old width opens)."""
        old, live = self.width, self.holders
        self.nodes = {
            block: (v & live) | ((v >> old) & live) << width | (v >> 2 * old) << 2 * width
            for block, v in self.nodes.items()
        }
        self._set_width(width)
        self._cap = sys.getsizeof(self.nodes)

    # --- internals ----------------------------------------------------------------------

    def _set_width(self, width: int) -> None:
        self.width = width
        self.holders = (1 << width) - 1  # the holders bits
        self.keep = (1 << 2 * width) - 1  # holders and child holders: an entry lives while set

    def _add_child(self, block: int, bit: int) -> None:
        counts = self.multi.setdefault(block, {})
        counts[bit] = counts.get(bit, 1) + 1

    def _drop_child(self, block: int, bit: int, counts: dict[int, int]) -> None:
        left = counts[bit] - 1
        if left > 1:
            counts[bit] = left
            return
        del counts[bit]
        if not counts:
            del self.multi[block]

    def _compact(self) -> None:
        # The dict just grew. If it grew because deletions used up its slots, a copy at the
        # compact size (what dict(d) builds) has room to spare: take it. If it grew because
        # it is full of live entries, keep it.
        n = len(self.nodes)
        slots = 8  # dict(d) sizes its table for (3n + 1) / 2 slots, 2/3 of them usable
        while slots < (3 * n + 1) // 2:
            slots *= 2
        if slots * 2 // 3 >= n * _HEADROOM:
            self.nodes = dict(self.nodes)
        self._cap = sys.getsizeof(self.nodes)
