"""Prefix cache over pages: matching, reference counts, leaf-first LRU eviction, events."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from refengine.kv_events import BlockRemoved, BlockStored, EventRecorder
from refengine.kv_pool import PageAllocator
from refengine.page_hash import hash_str_to_int64, page_digests
from refengine.prefix_cache import PrefixCache

P = 4


def _cache(pages: int = 8) -> PrefixCache:
    return PrefixCache(P, PageAllocator(pages), EventRecorder(True))


def _store(cache: PrefixCache, tokens: list[int]) -> list[int]:
    digests = page_digests(tokens, P)
    have = cache.match(digests)
    cache.acquire(have)
    new = cache.allocator.alloc(len(digests) - len(have))
    parent = digests[len(have) - 1] if have else None
    cache.insert(digests[len(have) :], new, tokens[len(have) * P :], parent, None)
    return have + new


def test_match_returns_longest_cached_prefix() -> None:
    """A prompt matches the cached pages it shares from its first page on."""
    cache = _cache()
    pages = _store(cache, list(range(12)))
    assert cache.match(page_digests(list(range(12)), P)) == pages
    assert cache.match(page_digests([*range(8), 99, 98, 97, 96], P)) == pages[:2]
    assert cache.match(page_digests([5, *range(11)], P)) == []


def test_insert_records_one_chained_store_event() -> None:
    """Inserted pages produce one BlockStored with SGLang int64 hashes and the tokens."""
    cache = _cache()
    _store(cache, list(range(8)))
    (event,) = cache.recorder.take()
    digests = page_digests(list(range(8)), P)
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [hash_str_to_int64(d) for d in digests]
    assert event.parent_block_hash is None and event.token_ids == list(range(8))


def test_referenced_pages_are_never_evicted() -> None:
    """Eviction only takes unreferenced pages, leaves first, and records BlockRemoved."""
    cache = _cache(4)
    pages = _store(cache, list(range(8)))
    cache.recorder.take()
    assert cache.evict(10) == 0
    cache.release(pages)
    assert cache.num_evictable == 2
    assert cache.evict(1) == 1
    (removed,) = cache.recorder.take()
    leaf = page_digests(list(range(8)), P)[1]
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [hash_str_to_int64(leaf)]
    assert cache.match(page_digests(list(range(8)), P)) == pages[:1]


def test_lru_prefers_the_least_recently_released() -> None:
    """Of two unreferenced leaves, the one released earlier goes first."""
    cache = _cache(4)
    a = _store(cache, [1, 1, 1, 1])
    b = _store(cache, [2, 2, 2, 2])
    cache.release(a)
    cache.release(b)
    cache.evict(1)
    assert cache.match(page_digests([1, 1, 1, 1], P)) == []
    assert cache.match(page_digests([2, 2, 2, 2], P)) == b


def test_clear_drops_everything_and_records_cleared() -> None:
    """clear() frees every page and leaves only AllBlocksCleared pending."""
    cache = _cache(4)
    cache.release(_store(cache, list(range(8))))
    cache.clear()
    assert cache.num_cached == 0 and cache.allocator.num_free == 4
    assert [type(e).__name__ for e in cache.recorder.take()] == ["AllBlocksCleared"]


class CacheMachine(RuleBasedStateMachine):
    """Random stores, releases and evictions conserve pages and keep counts consistent."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = _cache(16)
        self.held: list[list[int]] = []

    @rule(prefix=st.integers(0, 3), length=st.integers(1, 3), tail=st.integers(0, 5))
    def store(self, prefix: int, length: int, tail: int) -> None:
        tokens = [prefix] * P + [tail] * (P * (length - 1))
        digests = page_digests(tokens, P)
        have = self.cache.match(digests)
        self.cache.acquire(have)
        need = len(digests) - len(have)
        if not self.cache.ensure_free(need):
            self.cache.release(have)
            return
        new = self.cache.allocator.alloc(need)
        parent = digests[len(have) - 1] if have else None
        tail = tokens[len(have) * P :]
        inserted = self.cache.insert(digests[len(have) :], new, tail, parent, None)
        assert all(inserted)
        self.held.append(have + new)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.held:
            i = data.draw(st.integers(0, len(self.held) - 1))
            self.cache.release(self.held.pop(i))

    @rule(n=st.integers(1, 8))
    def evict(self, n: int) -> None:
        self.cache.evict(n)

    @invariant()
    def pages_are_conserved(self) -> None:
        c = self.cache
        assert c.allocator.num_free + c.num_cached == c.allocator.num_pages
        held = {p for pages in self.held for p in pages}
        assert len(held) == c.num_cached - c.num_evictable
        assert all(c.is_cached(p) for p in held)


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
