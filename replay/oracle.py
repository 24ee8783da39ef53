"""Upper bounds on the hit rate: one pooled cache holding every replica's capacity.

Routing can at best make N caches of C behave like one cache of N×C that every request sees
(no block stored twice, no request sent where its prefix is not). Two pooled bounds, walked in
arrival order at trace-block granularity (a block costs 512 tokens of capacity):

* **pooled LRU**: perfect routing with the engines' own eviction policy (LRU, leaf-first);
* **pooled Belady (MIN)**: perfect routing *and* perfect eviction — evict the block whose next
  use is furthest in the future (never-used-again first; ties: the deeper block). It is the
  true optimum for a given total capacity, hence "the best hit rate achievable with the same
  total capacity". With prefix-hash ids a parent is always needed no later than its children,
  so MIN keeps the cache prefix-closed by itself: a hit is always a leading run.

Neither bound charges for running requests' pinned blocks or generated tokens, so both are
optimistic for the timed simulation, as a bound should be.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from replay.traces import TRACE_BLOCK_TOKENS, TraceRecord

__all__ = ["OracleResult", "pooled_belady", "pooled_lru"]


@dataclass(frozen=True, slots=True)
class OracleResult:
    name: str
    capacity_blocks: int
    hit_blocks: int
    total_blocks: int
    hit_tokens: int
    total_tokens: int

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def hit_rate(self) -> float:
        """Token-weighted: cached prompt tokens / prompt tokens."""
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0


def _block_tokens(record: TraceRecord, j: int) -> int:
    return min(TRACE_BLOCK_TOKENS, record.input_tokens - j * TRACE_BLOCK_TOKENS)


def pooled_lru(records: Sequence[TraceRecord], capacity_blocks: int) -> OracleResult:
    """One LRU cache of ``capacity_blocks`` blocks, prefix semantics, leaves evicted first."""
    if capacity_blocks < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity_blocks}")
    lru: OrderedDict[int, None] = OrderedDict()
    hit_blocks = total_blocks = hit_tokens = total_tokens = 0
    for record in records:
        ids = record.hash_ids
        total_blocks += len(ids)
        total_tokens += record.input_tokens
        j = 0
        while j < len(ids) and ids[j] in lru:
            hit_tokens += _block_tokens(record, j)
            j += 1
        hit_blocks += j
        # Touch leaf first so the root ends most recent: parents outlive their children.
        for key in reversed(ids):
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return OracleResult(
        "pooled-lru", capacity_blocks, hit_blocks, total_blocks, hit_tokens, total_tokens
    )


def pooled_belady(records: Sequence[TraceRecord], capacity_blocks: int) -> OracleResult:
    """One cache of ``capacity_blocks`` blocks under Belady's MIN (with bypass)."""
    if capacity_blocks < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity_blocks}")
    never = math.inf
    # next_use[i][j]: index of the next request after i that uses block j's id
    next_use: list[list[float]] = [[] for _ in records]
    seen: dict[int, float] = {}
    for i in range(len(records) - 1, -1, -1):
        ids = records[i].hash_ids
        next_use[i] = [seen.get(key, never) for key in ids]
        for key in ids:
            seen[key] = i
    cached: dict[int, float] = {}  # id → its next use
    heap: list[tuple[float, int, int]] = []  # (−next use, −depth, id), lazily invalidated
    hit_blocks = total_blocks = hit_tokens = total_tokens = 0
    for i, record in enumerate(records):
        ids = record.hash_ids
        total_blocks += len(ids)
        total_tokens += record.input_tokens
        j = 0
        while j < len(ids) and ids[j] in cached:
            hit_tokens += _block_tokens(record, j)
            j += 1
        hit_blocks += j
        for depth, (key, nxt) in enumerate(zip(ids, next_use[i], strict=True)):
            cached[key] = nxt
            heapq.heappush(heap, (-nxt, -depth, key))
        while len(cached) > capacity_blocks:
            neg_next, _, key = heapq.heappop(heap)
            if cached.get(key) == -neg_next:
                del cached[key]
    return OracleResult(
        "pooled-belady", capacity_blocks, hit_blocks, total_blocks, hit_tokens, total_tokens
    )
