"""One simulated replica: the engine's timing and cache policy, and closed forms that are exact."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from refengine.timing import TimingModel
from replay.notes import Stored
from replay.offline import FleetConfig, simulate
from replay.replica import ReplicaSim, SimRequest
from replay.traces import TraceRecord, load_trace
from routing.config import RouterMode

SHARED = Path(__file__).resolve().parents[4] / "shared" / "traces"


def _record(index: int, ids: list[int], tokens: int, out: int, at: float = 0.0) -> TraceRecord:
    return TraceRecord(index, at, tokens, out, tuple(ids))


def _run(replica: ReplicaSim, *requests: SimRequest) -> None:
    for req in sorted(requests, key=lambda r: r.arrival):
        replica.advance(req.arrival)
        replica.add(req)
    replica.advance(math.inf)


@pytest.mark.parametrize("closed_form", [True, False])
def test_a_lone_request_takes_the_timing_models_steps(closed_form: bool) -> None:
    """TTFT is the sum of its prefill chunks, e2e adds one decode step per further token."""
    timing = TimingModel()
    replica = ReplicaSim(
        "w", capacity_tokens=100_000, timing=timing, chunk_size=512, closed_form=closed_form
    )
    req = SimRequest(_record(0, [1, 2, 3, 4, 5], 2300, 40), 0.0)
    _run(replica, req)
    prefill = sum(
        timing.prefill([(min(512, 2300 - s), min(s + 512, 2300))]) for s in range(0, 2300, 512)
    )
    decode = sum(timing.decode([2300 + n]) for n in range(1, 40))
    assert req.ttft == pytest.approx(prefill, rel=1e-12)
    assert req.e2e == pytest.approx(prefill + decode, rel=1e-12)
    assert req.itl_count == 39
    assert req.itl_mean == pytest.approx(decode / 39, rel=1e-12)
    assert req.cached_tokens == 0


def test_a_repeated_prompt_hits_every_block_but_one_page() -> None:
    """The second identical request reuses all full pages, keeping one token to compute."""
    replica = ReplicaSim("w", capacity_tokens=100_000, timing=TimingModel())
    first = SimRequest(_record(0, [1, 2, 3], 1536, 5), 0.0)
    second = SimRequest(_record(1, [1, 2, 3], 1536, 5), 100.0)
    partial = SimRequest(_record(2, [1, 2, 7], 1100, 5), 200.0)
    _run(replica, first, second, partial)
    assert first.cached_tokens == 0
    assert second.cached_tokens == 1536 - 16
    assert partial.cached_tokens == 1024
    stored = [(n.ids, n.parent) for n in replica.outbox if isinstance(n, Stored)]
    assert stored == [([1], None), ([2], 1), ([3], 2), ([7], 2)]  # one per 512-token chunk


def test_an_oversized_request_fails_alone() -> None:
    """A request larger than the whole cache gets an error; the next one is served."""
    replica = ReplicaSim("w", capacity_tokens=2048, timing=TimingModel())
    big = SimRequest(_record(0, [1, 2, 3, 4, 5], 2500, 10), 0.0)
    small = SimRequest(_record(1, [9], 300, 10), 0.0)
    _run(replica, big, small)
    assert big.error is not None and "2048" in big.error
    assert small.error is None and math.isfinite(small.e2e)


def test_a_full_cache_queues_requests_and_returns_every_page() -> None:
    """Reservations make later requests wait; at the end nothing is private or reserved."""
    replica = ReplicaSim("w", capacity_tokens=8192, timing=TimingModel())
    reqs = [
        SimRequest(_record(i, [100 * i + k for k in range(6)], 3000, 200), 0.0) for i in range(5)
    ]
    _run(replica, *reqs)
    assert all(math.isfinite(r.finished) for r in reqs)
    assert reqs[-1].admitted > reqs[-1].arrival
    assert replica.reserved == 0
    assert replica.cache.private_pages == 0
    assert replica.cache.cached_pages <= replica.cache.capacity_pages


@pytest.mark.parametrize("policy", [RouterMode.KV, RouterMode.ROUND_ROBIN])
def test_closed_forms_match_stepping_one_by_one(policy: RouterMode) -> None:
    """On a real, overloaded trace slice the closed forms reproduce every step exactly."""
    records = load_trace(SHARED / "conversation_trace.jsonl", limit=500)
    fast = simulate(records, policy, FleetConfig(replicas=3, capacity_tokens=400_000))
    slow = simulate(
        records, policy, FleetConfig(replicas=3, capacity_tokens=400_000, closed_form=False)
    )
    for a, b in zip(fast.requests, slow.requests, strict=True):
        assert a.worker == b.worker
        assert a.cached_tokens == b.cached_tokens
        assert a.ttft == pytest.approx(b.ttft, abs=1e-9)
        assert a.e2e == pytest.approx(b.e2e, abs=1e-9)
        assert a.itl_count == b.itl_count
