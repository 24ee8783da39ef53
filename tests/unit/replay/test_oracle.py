"""Pooled bounds: LRU and Belady on hand cases and against the traces README's figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.oracle import pooled_belady, pooled_lru
from replay.traces import TraceRecord, load_trace

SHARED = Path(__file__).resolve().parents[4] / "shared" / "traces"


def _reqs(*chains: list[int]) -> list[TraceRecord]:
    return [TraceRecord(i, float(i), 512 * len(c), 1, tuple(c)) for i, c in enumerate(chains)]


def test_belady_keeps_the_block_needed_next_where_lru_drops_it() -> None:
    """Capacity 2, accesses 1, 2, 3, 1: LRU evicted 1, MIN kept it."""
    records = _reqs([1], [2], [3], [1])
    assert pooled_lru(records, 2).hit_blocks == 0
    assert pooled_belady(records, 2).hit_blocks == 1


def test_hits_are_leading_runs_weighted_by_tokens() -> None:
    """A request counts only its cached leading blocks, and a partial block by its tokens."""
    records = [
        TraceRecord(0, 0.0, 1536, 1, (1, 2, 3)),
        TraceRecord(1, 1.0, 1100, 1, (1, 2, 4)),
    ]
    for bound in (pooled_lru(records, 10), pooled_belady(records, 10)):
        assert bound.hit_blocks == 2
        assert bound.hit_tokens == 1024
        assert bound.hit_rate == pytest.approx(1024 / 2636)


def test_unbounded_capacity_gives_the_repeat_fraction() -> None:
    """With room for everything both bounds equal the README's infinite-cache 36.6 %."""
    records = load_trace(SHARED / "conversation_trace.jsonl")
    lru = pooled_lru(records, 10**6)
    belady = pooled_belady(records, 10**6)
    assert lru.block_hit_rate == pytest.approx(0.366, abs=0.001)
    assert belady.hit_blocks == lru.hit_blocks


@pytest.mark.parametrize(("blocks", "readme"), [(5_000, 0.110), (20_000, 0.287)])
def test_pooled_lru_matches_the_readme_table(blocks: int, readme: float) -> None:
    """The pooled LRU bound reproduces the traces README's finite-LRU hit rates."""
    records = load_trace(SHARED / "conversation_trace.jsonl")
    result = pooled_lru(records, blocks)
    assert result.block_hit_rate == pytest.approx(readme, abs=0.003)
    assert pooled_belady(records, blocks).hit_blocks >= result.hit_blocks


def test_capacity_must_be_positive() -> None:
    """A zero-block pool is refused."""
    with pytest.raises(ValueError, match="capacity"):
        pooled_belady(_reqs([1]), 0)
