"""One simulated replica's prefix cache, at trace-block granularity.

The reference engine's cache (``refengine/prefix_cache.py``) works on pages: full pages are
cached under a chained digest, pages referenced by running requests are pinned, and an
unreferenced page with no cached child is evictable, least recently used first (leaves go
before their parents). This model keeps exactly that policy but with a coarser unit, one trace
block (512 tokens = 32 pages of 16), so an hour-long trace simulates in seconds:

* a node is one trace id; its size is the number of *full pages* it covers (32 for a whole
  block; fewer for the partial last block of a prompt; output tokens are one private node per
  request, ``key < 0``, never matched by anyone, as the engine's output pages never are);
* capacity, reservation and eviction are counted in pages, like the engine's allocator;
* evictions are buffered in ``removed`` (trace ids only) for the replica to publish.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BlockCache"]


@dataclass(slots=True)
class _Node:
    size: int  # pages
    parent: int | None
    refs: int
    children: int
    last_access: int


class BlockCache:
    """Trace id → cached node, with refcounts and LRU eviction of unreferenced leaves."""

    def __init__(self, capacity_pages: int) -> None:
        if capacity_pages < 1:
            raise ValueError(f"cache capacity must be >= 1 page, got {capacity_pages}")
        self.capacity_pages = capacity_pages
        self.cached_pages = 0
        self.private_pages = 0  # allocated to requests, not (yet) in the cache
        self.unreferenced_pages = 0
        self.removed: list[int] = []  # evicted trace ids, drained by the replica
        self.evicted_pages = 0
        self._nodes: dict[int, _Node] = {}
        self._heap: list[tuple[int, int]] = []  # (last_access, key) of evictable candidates
        self._tick = itertools.count()

    # --- queries ------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return self.capacity_pages - self.cached_pages - self.private_pages

    @property
    def available_pages(self) -> int:
        """Free pages plus those eviction could free (every unreferenced cached page)."""
        return self.free_pages + self.unreferenced_pages

    def __contains__(self, key: int) -> bool:
        return key in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def size_of(self, key: int) -> int:
        return self._nodes[key].size

    def match(self, keys: Sequence[int], full_size: int) -> tuple[list[int], int]:
        """The longest cached run of ``keys`` from the first, and the pages it covers; a node
        smaller than ``full_size`` (a partial block) ends the run."""
        nodes = self._nodes
        out: list[int] = []
        pages = 0
        for key in keys:
            node = nodes.get(key)
            if node is None:
                break
            out.append(key)
            pages += node.size
            if node.size < full_size:
                break
        return out, pages

    # --- references ---------------------------------------------------------------------

    def acquire(self, keys: Sequence[int]) -> None:
        nodes = self._nodes
        for key in keys:
            node = nodes[key]
            if node.refs == 0:
                self.unreferenced_pages -= node.size
            node.refs += 1

    def release(self, keys: Sequence[int]) -> None:
        nodes = self._nodes
        for key in keys:
            node = nodes[key]
            if node.refs <= 0:
                raise RuntimeError(f"node {key} released more often than acquired")
            node.refs -= 1
            node.last_access = next(self._tick)
            if node.refs == 0:
                self.unreferenced_pages += node.size
                if node.children == 0:
                    heapq.heappush(self._heap, (node.last_access, key))

    # --- allocation ---------------------------------------------------------------------

    def allocate(self, pages: int) -> None:
        """Hand ``pages`` private pages to a request, evicting if needed (the caller holds a
        reservation, so they must be obtainable)."""
        if pages <= 0:
            return
        short = pages - self.free_pages
        if short > 0:
            self.evict(short)
            if self.free_pages < pages:
                raise RuntimeError("reserved pages are not available: accounting is broken")
        self.private_pages += pages

    def free(self, pages: int) -> None:
        self.private_pages -= pages

    def insert(self, key: int, parent: int | None, size: int) -> bool:
        """Cache ``size`` of the caller's private pages under ``key``, referenced once by the
        caller. False (nothing moved) if ``key`` is already cached: the caller then acquires
        the cached node and keeps its own pages private, as the engine does."""
        if key in self._nodes:
            return False
        if parent is not None:
            parent_node = self._nodes.get(parent)
            if parent_node is None:
                raise RuntimeError(f"inserting {key} would orphan it: parent {parent} not cached")
            parent_node.children += 1
        self._nodes[key] = _Node(size, parent, 1, 0, next(self._tick))
        self.private_pages -= size
        self.cached_pages += size
        return True

    def evict(self, pages: int) -> int:
        """Free at least ``pages`` pages (if possible), LRU leaves first; returns pages freed."""
        freed = 0
        nodes = self._nodes
        heap = self._heap
        while freed < pages and heap:
            last_access, key = heapq.heappop(heap)
            node = nodes.get(key)
            if node is None or node.refs or node.children or node.last_access != last_access:
                continue  # stale entry
            del nodes[key]
            freed += node.size
            self.cached_pages -= node.size
            self.unreferenced_pages -= node.size
            if key >= 0:
                self.removed.append(key)
            if node.parent is not None:
                parent = nodes[node.parent]
                parent.children -= 1
                if parent.refs == 0 and parent.children == 0:
                    heapq.heappush(heap, (parent.last_access, node.parent))
        self.evicted_pages += freed
        return freed
