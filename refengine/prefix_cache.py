"""Prefix caching over device pages: a hash chain keyed by SGLang's page digests.

A cached page is a full page whose digest (the SHA-256 chain of the tokens before and in it,
see :mod:`refengine.page_hash`) names its content. A request's prompt matches the longest run
of cached pages from its first page. Pages referenced by running requests are pinned; an
unreferenced page with no cached child is evictable, least recently used first — so, as in
SGLang's radix cache, leaves go before their parents and a published chain never has a hole.
Every insert and eviction is recorded as a BlockStored / BlockRemoved event.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from refengine.kv_events import EventRecorder
from refengine.kv_pool import PageAllocator
from refengine.page_hash import hash_str_to_int64

__all__ = ["PrefixCache"]


@dataclass(slots=True)
class _Page:
    page_id: int
    digest: bytes
    parent: bytes | None
    refs: int
    children: int
    last_access: int


class PrefixCache:
    """Digest → page map with reference counts and LRU eviction of unreferenced leaves."""

    def __init__(self, page_size: int, allocator: PageAllocator, recorder: EventRecorder) -> None:
        self.page_size = page_size
        self.allocator = allocator
        self.recorder = recorder
        self._pages: dict[bytes, _Page] = {}
        self._by_id: dict[int, _Page] = {}
        self._heap: list[tuple[int, int, bytes]] = []
        self._tick = itertools.count()
        self._unreferenced = 0

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_cached(self) -> int:
        return len(self._pages)

    @property
    def num_evictable(self) -> int:
        """Unreferenced cached pages: all of them can be freed, leaves first."""
        return self._unreferenced

    @property
    def num_available(self) -> int:
        return self.allocator.num_free + self._unreferenced

    def match(self, digests: Sequence[bytes]) -> list[int]:
        """Page ids of the longest cached prefix of ``digests``."""
        out = []
        for d in digests:
            page = self._pages.get(d)
            if page is None:
                break
            out.append(page.page_id)
        return out

    def is_cached(self, page_id: int) -> bool:
        return page_id in self._by_id

    # -- references ---------------------------------------------------------------------------

    def acquire(self, page_ids: Sequence[int]) -> None:
        for pid in page_ids:
            page = self._by_id[pid]
            if page.refs == 0:
                self._unreferenced -= 1
            page.refs += 1

    def release(self, page_ids: Sequence[int]) -> None:
        """Drop one reference from each cached page; pages not (or no longer) cached are
        returned to the allocator by the caller, not here."""
        for pid in page_ids:
            page = self._by_id[pid]
            if page.refs <= 0:
                raise RuntimeError(f"page {pid} released more often than acquired")
            page.refs -= 1
            page.last_access = next(self._tick)
            if page.refs == 0:
                self._unreferenced += 1
                self._push_if_evictable(page)

    def _push_if_evictable(self, page: _Page) -> None:
        if page.refs == 0 and page.children == 0:
            heapq.heappush(self._heap, (page.last_access, page.page_id, page.digest))

    # -- insert / evict -----------------------------------------------------------------------

    def insert(
        self,
        digests: Sequence[bytes],
        page_ids: Sequence[int],
        tokens: Sequence[int],
        first_parent: bytes | None,
        cache_salt: str | None,
    ) -> list[bool]:
        """Cache consecutive full pages (already computed, owned by the caller with one
        reference each). ``first_parent`` is the digest before ``digests[0]`` (None at the
        root). Returns, per page, whether it was inserted; a page whose digest was already
        cached stays private to the caller, who frees it when done."""
        inserted = []
        parent = first_parent
        run_hashes: list[int] = []
        run_tokens: list[int] = []
        run_parent: int | None = None
        for i, (digest, pid) in enumerate(zip(digests, page_ids, strict=True)):
            if digest in self._pages:
                inserted.append(False)
                self._flush_run(run_hashes, run_parent, run_tokens, cache_salt)
                run_hashes, run_tokens = [], []
                parent = digest
                continue
            if parent is not None and parent not in self._pages:
                raise RuntimeError("cache insert would orphan a page: its parent is not cached")
            page = _Page(pid, digest, parent, refs=1, children=0, last_access=next(self._tick))
            self._pages[digest] = page
            self._by_id[pid] = page
            if parent is not None:
                self._pages[parent].children += 1
            if not run_hashes:
                run_parent = None if parent is None else hash_str_to_int64(parent)
            run_hashes.append(hash_str_to_int64(digest))
            run_tokens.extend(tokens[i * self.page_size : (i + 1) * self.page_size])
            inserted.append(True)
            parent = digest
        self._flush_run(run_hashes, run_parent, run_tokens, cache_salt)
        return inserted

    def _flush_run(
        self, hashes: list[int], parent: int | None, tokens: list[int], salt: str | None
    ) -> None:
        self.recorder.stored(hashes, parent, tokens, self.page_size, cache_salt=salt)

    def evict(self, n: int) -> int:
        """Free up to ``n`` unreferenced pages, LRU leaves first; returns how many."""
        freed: list[int] = []
        removed: list[int] = []
        while len(freed) < n and self._heap:
            last_access, pid, digest = heapq.heappop(self._heap)
            page = self._pages.get(digest)
            if (
                page is None
                or page.page_id != pid
                or page.refs
                or page.children
                or page.last_access != last_access
            ):
                continue  # stale heap entry
            del self._pages[digest]
            del self._by_id[pid]
            self._unreferenced -= 1
            freed.append(pid)
            removed.append(hash_str_to_int64(digest))
            if page.parent is not None:
                parent = self._pages[page.parent]
                parent.children -= 1
                self._push_if_evictable(parent)
        self.recorder.removed(removed)
        self.allocator.free(freed)
        return len(freed)

    def ensure_free(self, n: int) -> bool:
        """Evict until ``n`` pages are free; False (nothing evicted) if that is impossible."""
        if self.num_available < n:
            return False
        short = n - self.allocator.num_free
        if short > 0:
            self.evict(short)
        return self.allocator.num_free >= n

    def clear(self) -> None:
        """Drop every cached page (none may be referenced) and record AllBlocksCleared."""
        if any(p.refs for p in self._pages.values()):
            raise RuntimeError("cannot clear the prefix cache while requests hold pages")
        self.allocator.free(p.page_id for p in self._pages.values())
        self._pages.clear()
        self._by_id.clear()
        self._heap.clear()
        self._unreferenced = 0
        self.recorder.take()  # pending events describe pages that no longer exist
        self.recorder.cleared()
