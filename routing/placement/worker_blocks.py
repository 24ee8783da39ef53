"""One worker's blocks in one tier: a dict block → parent whose values cost nothing.

Why per worker: a block's parent is what the worker reported, so each worker keeps its own
``block → parent`` dict. The value is the parent's own key object (the int the dict already
holds; a root block points at itself), so an entry costs one dict slot and one key int: about
70 bytes, where one shared dict packing holders and parent into a new int per block cost ~106.

Beside the dict: ``leaves`` (held blocks with no held child), ``multi`` (blocks with two or
more held children: how many) and ``lost`` (parents the worker does not hold: how many held
children each has). Every other held block has exactly one held child. So removing a block
knows, in O(1), how many of its children become orphans, and removing a child knows whether
its parent becomes a leaf. ``orphans`` (held blocks whose parent is not held) is
``sum(lost.values())``, kept as a counter.

``heads`` (one per tier, shared by every worker) maps each block some worker holds as a root
(parent None) to the mask of every worker holding it, as a root or not: the holders of a
request's block 0 in one lookup (``PrefixIndex.match``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from routing.placement.index_stats import IndexStats

__all__ = ["WorkerBlocks"]

_HEADROOM = 1.25  # rebuild a dict grown past its live entries when a copy has this much room


class WorkerBlocks:
    """The blocks one worker (``bit``, its mask in ``heads``) holds in one tier."""

    __slots__ = ("_cap", "bit", "blocks", "leaves", "lost", "multi", "orphans", "par")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.blocks = 0
        self.orphans = 0
        self.par: dict[int, int] = {}
        self.leaves: set[int] = set()
        self.multi: dict[int, int] = {}
        self.lost: dict[int, int] = {}
        self._cap = 0

    def store(self, blocks: Sequence[int], parent: int | None, heads: dict[int, int],
              stats: IndexStats) -> int | None:
        """Add a chain of blocks under ``parent``; returns the block it added as a new
        key of ``heads`` (only the first can be one), whose other holders the caller adds."""
        par, leaves, multi, lost = self.par, self.leaves, self.multi, self.lost
        bit = self.bit
        orphans, count = self.orphans, self.blocks
        new_head = None
        prev = parent
        fresh = False  # prev was added by this loop: already known to have this one child
        last_new = None  # the newest block added: a leaf unless a later one is its child
        for b in blocks:
            if b in par:
                stats.duplicate_blocks += 1
                if last_new is not None:
                    leaves.add(last_new)
                    last_new = None
                prev, fresh = b, False
                continue
            if prev is None:
                par[b] = b
                mask = heads.get(b)
                if mask is None:
                    heads[b] = bit
                    new_head = b
                else:
                    heads[b] = mask | bit
            else:
                if not fresh:
                    if prev in leaves:
                        leaves.discard(prev)
                        # Re-key it with this event's int object, so that this child's
                        # value shares the key's object instead of holding its own.
                        pp = par.pop(prev)
                        par[prev] = prev if pp == prev else pp
                    elif prev in par:
                        multi[prev] = multi.get(prev, 1) + 1
                    else:
                        lost[prev] = lost.get(prev, 0) + 1
                        orphans += 1
                par[b] = prev
                if b in heads:
                    heads[b] |= bit
            count += 1
            if lost and b in lost:  # it comes back under children that lost it
                kids = lost.pop(b)
                orphans -= kids
                if kids > 1:
                    multi[b] = kids
                last_new = None
                prev, fresh = b, False
                continue
            last_new = b
            prev, fresh = b, True
        if last_new is not None:
            leaves.add(last_new)
        self.blocks, self.orphans = count, orphans
        if par.__sizeof__() > self._cap:
            self._fit()
        return new_head

    def remove(self, blocks: Sequence[int], heads: dict[int, int], stats: IndexStats) -> None:
        """Drop ``blocks``; children of a dropped block become orphans."""
        par, leaves, multi, lost = self.par, self.leaves, self.multi, self.lost
        keep = ~self.bit
        orphans, count = self.orphans, self.blocks
        pop = par.pop
        for b in blocks:
            p = pop(b, None)
            if p is None:
                stats.unknown_removals += 1
                continue
            count -= 1
            if b in leaves:
                leaves.discard(b)
            else:
                n = multi.pop(b, 1) if multi else 1
                orphans += n
                lost[b] = n
            mask = heads.get(b)
            if mask is not None:
                mask &= keep
                if mask:
                    heads[b] = mask
                else:
                    del heads[b]
            if p != b:
                if p in par:
                    c = multi.get(p) if multi else None
                    if c is None:
                        leaves.add(p)
                    elif c == 2:
                        del multi[p]
                    else:
                        multi[p] = c - 1
                else:
                    orphans -= 1
                    n = lost[p] - 1
                    if n:
                        lost[p] = n
                    else:
                        del lost[p]
        self.blocks, self.orphans = count, orphans
        if not count:
            self.clear(heads)

    def clear(self, heads: dict[int, int]) -> None:
        """Drop every block (fresh containers: a dict never shrinks by deleting)."""
        par, keep = self.par, ~self.bit
        if par:
            for b in (heads.keys() & par.keys()) if len(heads) < len(par) else par:
                mask = heads.get(b)
                if mask is not None:
                    mask &= keep
                    if mask:
                        heads[b] = mask
                    else:
                        del heads[b]
        self.par, self.leaves, self.multi, self.lost = {}, set(), {}, {}
        self.blocks = self.orphans = self._cap = 0

    def copy(self) -> WorkerBlocks:
        other = WorkerBlocks(self.bit)
        other.par, other.leaves = self.par.copy(), self.leaves.copy()
        other.multi, other.lost = self.multi.copy(), self.lost.copy()
        other.blocks, other.orphans, other._cap = self.blocks, self.orphans, self._cap
        return other

    def adopt(self, par: dict[int, int], roots: Iterable[int]) -> None:
        """Take over a whole ``block → parent`` dict (``roots`` map to themselves) and
        derive the rest from it: what a loaded ``IndexImage`` builds."""
        kids = Counter(par.values())
        for b in roots:
            n = kids[b] - 1
            if n:
                kids[b] = n
            else:
                del kids[b]
        self.par = par
        self.leaves = set(par).difference(kids)
        self.lost = {b: n for b, n in kids.items() if b not in par}
        self.multi = {b: n for b, n in kids.items() if n > 1 and b in par}
        self.blocks, self.orphans = len(par), sum(self.lost.values())
        self._cap = par.__sizeof__()

    def _fit(self) -> None:
        # The dict just grew. If it grew because deletions used up its slots, a copy at the
        # compact size (what dict(d) builds) has room to spare: take it. If it grew because
        # it is full of live entries, keep it.
        n = len(self.par)
        slots = 8  # dict(d) sizes its table for (3n + 1) / 2 slots, 2/3 of them usable
        while slots < (3 * n + 1) // 2:
            slots *= 2
        if slots * 2 // 3 >= n * _HEADROOM:
            self.par = dict(self.par)
        self._cap = self.par.__sizeof__()
