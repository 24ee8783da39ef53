"""The block-granular cache: pins, LRU order, leaves before parents, page accounting."""

from __future__ import annotations

import pytest

from replay.cache_model import BlockCache


def _chain(cache: BlockCache, keys: list[int], size: int = 32) -> None:
    """Insert a chain as one request would (private pages first), then release it."""
    cache.allocate(size * len(keys))
    parent = None
    for key in keys:
        assert cache.insert(key, parent, size)
        parent = key
    cache.release(keys)


def test_match_returns_the_longest_cached_run_and_its_pages() -> None:
    """Only the leading run counts; a partial node ends the run."""
    cache = BlockCache(1000)
    _chain(cache, [1, 2, 3])
    assert cache.match([1, 2, 9, 3], 32) == ([1, 2], 64)
    cache.allocate(10)
    assert cache.insert(4, 3, 10)
    cache.release([4])
    assert cache.match([1, 2, 3, 4, 5], 32) == ([1, 2, 3, 4], 106)


def test_eviction_takes_least_recent_leaves_before_parents() -> None:
    """Leaves go first, oldest first; a parent goes only after its children."""
    cache = BlockCache(32 * 4)
    _chain(cache, [1, 2, 3])  # 1 → 2 → 3
    _chain(cache, [10])
    cache.allocate(32)  # full: must evict one block
    assert cache.removed == [3]
    cache.allocate(64)  # 2 became a leaf and is older than 10, then 1
    assert cache.removed == [3, 2, 1]
    assert 10 in cache


def test_referenced_nodes_are_never_evicted() -> None:
    """A pinned node survives; when nothing is evictable the allocation fails loudly."""
    cache = BlockCache(64)
    _chain(cache, [1, 2])
    cache.acquire([1, 2])
    assert cache.available_pages == 0
    with pytest.raises(RuntimeError, match="accounting"):
        cache.allocate(32)
    cache.release([2])
    cache.allocate(32)
    assert cache.removed == [2] and 1 in cache


def test_pages_are_conserved_through_insert_and_evict() -> None:
    """free + cached + private always equals capacity."""
    cache = BlockCache(500)
    _chain(cache, [1, 2, 3])
    cache.allocate(300)
    cache.free(300)
    assert cache.free_pages + cache.cached_pages + cache.private_pages == 500
    assert cache.unreferenced_pages == cache.cached_pages


def test_output_nodes_are_evicted_without_being_reported() -> None:
    """Negative keys (generated tokens) leave silently: no event names them."""
    cache = BlockCache(64)
    _chain(cache, [1])
    cache.allocate(20)
    assert cache.insert(-5, 1, 20)
    cache.release([-5])
    cache.allocate(30)  # 12 free: evicting the 20-page output node is enough
    assert cache.removed == [] and -5 not in cache and 1 in cache


def test_inserting_an_orphan_or_a_duplicate_is_refused() -> None:
    """A block whose parent is not cached raises; an already cached one returns False."""
    cache = BlockCache(100)
    _chain(cache, [1])
    cache.allocate(32)
    assert not cache.insert(1, None, 32)
    with pytest.raises(RuntimeError, match="orphan"):
        cache.insert(7, 6, 32)
