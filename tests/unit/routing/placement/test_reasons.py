"""Achieved vs achievable: the best overlap on offer and why the chosen worker won."""

from __future__ import annotations

import random

from kvcore import BlockHasher, Namespace
from kvcore.events import BlockStored, Tier
from routing.placement.kv_router import KvRouter
from routing.placement.policies import LeastLoaded, RoundRobin
from routing.placement.scorer import (
    Candidate,
    Placement,
    Pool,
    Reason,
    Scorer,
    ScoringWeights,
    TierOverlap,
    WorkerLoad,
)

HASHER = BlockHasher(16)
SEED = Namespace("m").seed


def cand(
    worker: str,
    gpu: int = 0,
    host: int = 0,
    remote: int = 0,
    prefill: int = 0,
    decode: int = 0,
    capacity: int | None = None,
) -> Candidate:
    return Candidate(
        worker, TierOverlap(gpu, host, 0, remote), WorkerLoad(prefill, decode, 0, capacity)
    )


def place(cands: list[Candidate], tokens: int = 160, **kw: object) -> Placement:
    scorer = Scorer(ScoringWeights(), 16, random.Random(0))
    placement = scorer.place(cands, tokens, **kw)  # type: ignore[arg-type]
    assert placement is not None
    return placement


class TestReasons:
    def test_best_when_the_deepest_worker_wins(self) -> None:
        placement = place([cand("deep", gpu=8), cand("shallow", gpu=2)])
        assert (placement.worker_id, placement.reason) == ("deep", Reason.BEST)
        assert placement.best_overlap == 8 and placement.overlap.longest == 8

    def test_load_when_a_busier_deeper_worker_loses(self) -> None:
        """The deeper worker holds 30 decode blocks of other requests: it costs more."""
        placement = place([cand("deep", gpu=8, decode=30), cand("idle", gpu=2)])
        assert (placement.worker_id, placement.reason) == ("idle", Reason.LOAD)
        assert placement.best_overlap == 8 and placement.overlap.longest == 2

    def test_queued_prefill_is_load_too(self) -> None:
        placement = place([cand("deep", gpu=8, prefill=16 * 40), cand("idle")])
        assert (placement.worker_id, placement.reason) == ("idle", Reason.LOAD)
        assert placement.best_overlap == 8

    def test_tier_when_the_deeper_match_is_in_a_slow_tier(self) -> None:
        """10 blocks on remote storage credit 1.0; 5 on GPU credit 5.0: the GPU wins."""
        placement = place([cand("remote", remote=10), cand("gpu", gpu=5)])
        assert (placement.worker_id, placement.reason) == ("gpu", Reason.TIER)
        assert placement.best_overlap == 10 and placement.overlap.longest == 5

    def test_capacity_when_the_deeper_worker_is_saturated(self) -> None:
        placement = place([cand("other", gpu=1)], saturated=[cand("full", gpu=9)])
        assert (placement.worker_id, placement.reason) == ("other", Reason.CAPACITY)
        assert placement.best_overlap == 9

    def test_saturated_shallower_worker_changes_nothing(self) -> None:
        placement = place([cand("a", gpu=4), cand("b")], saturated=[cand("full", gpu=2)])
        assert (placement.reason, placement.best_overlap) == (Reason.BEST, 4)

    def test_capacity_in_a_decode_pool_without_room(self) -> None:
        """A decode worker with no room for the request's blocks is never chosen."""
        placement = place(
            [cand("full", gpu=9, decode=120, capacity=100), cand("roomy", decode=20, capacity=100)],
            pool=Pool.DECODE,
        )
        assert (placement.worker_id, placement.reason) == ("roomy", Reason.CAPACITY)
        assert placement.best_overlap == 9

    def test_only_candidate(self) -> None:
        placement = place([cand("solo", gpu=3, decode=50)])
        assert (placement.reason, placement.best_overlap) == (Reason.ONLY_CANDIDATE, 3)

    def test_tie_when_drawn_among_equals(self) -> None:
        placement = place([cand("x"), cand("y")])
        assert (placement.reason, placement.best_overlap) == (Reason.TIE, 0)

    def test_no_tie_when_the_deeper_of_equal_costs_wins(self) -> None:
        """Equal costs go to the deeper overlap: that is the best, not a draw."""
        placement = place([cand("a", gpu=4, decode=4 + 8), cand("b", decode=8)], 128)
        assert (placement.worker_id, placement.reason) == ("a", Reason.BEST)

    def test_sampled_at_temperature(self) -> None:
        """At T > 0 a costlier, shallower worker drawn over the cheapest one reads sampled."""
        scorer = Scorer(ScoringWeights(temperature=5.0), 16, random.Random(1))
        cands = [cand("deep", gpu=8), cand("shallow", decode=40)]
        reasons = {}
        for _ in range(200):
            placement = scorer.place(cands, 160)
            assert placement is not None
            reasons[placement.worker_id] = placement.reason
        assert reasons == {"deep": Reason.BEST, "shallow": Reason.SAMPLED}

    def test_every_reason_is_listed(self) -> None:
        named = {v for k, v in vars(Reason).items() if k.isupper() and k != "ALL"}
        assert set(Reason.ALL) == named and len(Reason.ALL) == len(named) == 10


class TestRouter:
    def test_busy_holder_of_the_prefix_loses_on_load(self) -> None:
        """The worker holding the prompt's prefix carries a long request in flight: the
        request goes elsewhere, and the placement says what it gave up and why."""
        router = KvRouter(rng=random.Random(0))
        tokens = list(range(16 * 10))
        hashes = HASHER.hash_tokens(tokens, SEED)
        router.apply(BlockStored("w0", 0, 1, Tier.GPU, hashes))
        busy = HASHER.hash_tokens([10_000 + i for i in range(16 * 40)], SEED)
        router.load.add("held", "w0", busy, 16 * 40, 0)
        router.load.first_token("held")
        placement = router.place(hashes, len(tokens), ["w0", "w1"])
        assert placement is not None
        assert (placement.worker_id, placement.reason) == ("w1", Reason.LOAD)
        assert (placement.best_overlap, placement.overlap.longest) == (10, 0)

    def test_saturated_workers_count_as_achievable(self) -> None:
        router = KvRouter(rng=random.Random(0))
        tokens = list(range(16 * 6))
        hashes = HASHER.hash_tokens(tokens, SEED)
        router.apply(BlockStored("w0", 0, 1, Tier.GPU, hashes))
        placement = router.place(hashes, len(tokens), ["w1", "w2"], saturated=["w0"])
        assert placement is not None and placement.worker_id in ("w1", "w2")
        assert (placement.reason, placement.best_overlap) == (Reason.CAPACITY, 6)
        # excluded (already tried) workers are neither chosen nor achievable
        placement = router.place(
            hashes, len(tokens), ["w1", "w2"], exclude={"w0"}, saturated=["w0"]
        )
        assert placement is not None and placement.reason == Reason.TIE

    def test_unscored_policies_leave_it_unset(self) -> None:
        """Round-robin and least-loaded do no overlap work: no best, no reason."""
        router = KvRouter()
        for policy in (RoundRobin(), LeastLoaded(router)):
            placement = policy.choose([1, 2], 32, ["a", "b"], ())
            assert placement is not None
            assert (placement.reason, placement.best_overlap) == ("", 0)
