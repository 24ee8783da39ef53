"""The fleet simulation with the real routing core: complete, repeatable, sensible."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from replay.offline import FleetConfig, outcomes, simulate
from replay.summary import summarize
from replay.traces import load_trace
from routing.config import RouterMode

SHARED = Path(__file__).resolve().parents[4] / "shared" / "traces"


@pytest.fixture(scope="module")
def slice_() -> list:
    return load_trace(SHARED / "conversation_trace.jsonl", limit=600)


def _cfg(**kw: object) -> FleetConfig:
    return FleetConfig(replicas=4, capacity_tokens=500_000, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", list(RouterMode))
def test_every_request_completes_in_order(slice_: list, policy: RouterMode) -> None:
    """Each request is admitted after arrival, gets a first token, then finishes."""
    run = simulate(slice_, policy, _cfg())
    assert len(run.requests) == len(slice_)
    for r in run.requests:
        assert r.error is None
        assert r.arrival <= r.admitted <= r.first_token <= r.finished
        assert 0 <= r.cached_tokens < r.record.input_tokens
    assert {r.worker for r in run.requests} == set(_cfg().worker_ids)
    assert sum(run.busy_s.values()) > 0
    assert len(run.load) == len(slice_) and len(run.load[0]) == 4


def test_kv_beats_round_robin_and_predicts_what_it_gets(slice_: list) -> None:
    """kv placement hits more than round-robin, and its predictions match the engines."""
    cfg = FleetConfig(replicas=8, capacity_tokens=500_000)
    kv = summarize("kv", outcomes(simulate(slice_, RouterMode.KV, cfg)))
    rr = summarize("rr", outcomes(simulate(slice_, RouterMode.ROUND_ROBIN, cfg)))
    assert kv.hit_rate > 1.5 * rr.hit_rate
    assert kv.predicted_gap < 0.01


def test_runs_repeat_exactly_with_the_same_seed(slice_: list) -> None:
    """Same seed, same placements and times (random policy included)."""
    a = simulate(slice_, RouterMode.RANDOM, _cfg(seed=3))
    b = simulate(slice_, RouterMode.RANDOM, _cfg(seed=3))
    c = simulate(slice_, RouterMode.RANDOM, _cfg(seed=4))
    assert [r.worker for r in a.requests] == [r.worker for r in b.requests]
    assert [r.e2e for r in a.requests] == [r.e2e for r in b.requests]
    assert [r.worker for r in a.requests] != [r.worker for r in c.requests]


def test_speedup_compresses_arrivals_and_raises_latency(slice_: list) -> None:
    """Arriving 4× faster on the same fleet makes TTFT worse, never better."""
    base = summarize("a", outcomes(simulate(slice_, RouterMode.LEAST_LOADED, _cfg())))
    fast = summarize("b", outcomes(simulate(slice_, RouterMode.LEAST_LOADED, _cfg(speedup=4.0))))
    assert fast.ttft_p50 > base.ttft_p50
    assert math.isfinite(fast.itl_p99)


def test_bad_fleet_settings_are_refused() -> None:
    """Zero replicas, a cache smaller than a block and odd page sizes raise ValueError."""
    with pytest.raises(ValueError, match="--replicas"):
        FleetConfig(replicas=0, capacity_tokens=10_000)
    with pytest.raises(ValueError, match="--capacity-tokens"):
        FleetConfig(replicas=1, capacity_tokens=100)
    with pytest.raises(ValueError, match="--page-size"):
        FleetConfig(replicas=1, capacity_tokens=10_000, page_size=24)
