"""Placement cost and selection."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvcore.events import Tier
from routing.placement.scorer import (
    DEFAULT_TIER_WEIGHTS,
    Candidate,
    Pool,
    Scorer,
    ScoringWeights,
    TierOverlap,
    WorkerLoad,
)


def cand(
    worker: str,
    gpu: int = 0,
    host: int = 0,
    disk: int = 0,
    prefill: int = 0,
    decode: int = 0,
    capacity: int | None = None,
) -> Candidate:
    return Candidate(worker, TierOverlap(gpu, host, disk), WorkerLoad(prefill, decode, 0, capacity))


class TestCost:
    def test_formula(self) -> None:
        """cost = (active_prefill + prompt)/block_size − credit + decode_blocks."""
        scorer = Scorer(ScoringWeights(), block_size=16)
        c = cand("a", gpu=10, prefill=320, decode=40)
        assert scorer.cost(c, prompt_tokens=640) == (320 + 640) / 16 - 10 + 40

    def test_prefill_load_scale_weighs_prefill_against_decode(self) -> None:
        """prefill_load_scale multiplies the prefill term only (Dynamo's knob)."""
        scorer = Scorer(ScoringWeights(prefill_load_scale=4.0), block_size=16)
        c = cand("a", gpu=2, decode=10)
        assert scorer.cost(c, prompt_tokens=160) == 4.0 * (10 - 2) + 10
        cached, idle = cand("cached", gpu=8, decode=20), cand("idle")
        assert Scorer(ScoringWeights(), 16).place([cached, idle], 160).worker_id == "idle"  # type: ignore[union-attr]
        assert scorer.place([cached, idle], 160).worker_id == "cached"  # type: ignore[union-attr]

    def test_credit_is_not_clamped(self) -> None:
        """A credit beyond the prefill work keeps counting: deeper overlap still ranks first.

        With overlap weight 5, 4 and 10 cached blocks both cover a 10-block prompt; clamped at
        zero they would tie on prefill and the lighter decode load would win.
        """
        scorer = Scorer(ScoringWeights(overlap_weight=5.0), block_size=16)
        assert scorer.cost(cand("a", gpu=10, decode=3), prompt_tokens=160) == 10 - 50 + 3
        deep, shallow = cand("deep", gpu=10, decode=8), cand("shallow", gpu=4, decode=2)
        assert scorer.place([shallow, deep], 160).worker_id == "deep"  # type: ignore[union-attr]

    def test_tier_weights_on_exclusive_tiers(self) -> None:
        """Blocks beyond the GPU match are credited at host, then disk weight (Dynamo's sum)."""
        scorer = Scorer(ScoringWeights(), block_size=16)
        # gpu holds 0..3, host 0..9 (4..9 beyond gpu), disk 0..19 (10..19 beyond host).
        credit = scorer.credit_blocks(TierOverlap(4, 10, 20))
        assert credit == 1.0 * 4 + 0.75 * 6 + 0.25 * 10

    def test_block_in_two_tiers_is_credited_once(self) -> None:
        """A write-through block in GPU and host is credited at the GPU weight only."""
        scorer = Scorer(ScoringWeights(), block_size=16)
        assert scorer.credit_blocks(TierOverlap(8, 8)) == 8.0

    @pytest.mark.parametrize("field", ["overlap_weight", "temperature"])
    def test_rejects_negative_weights(self, field: str) -> None:
        """Negative or non-finite weights are rejected when the config is built."""
        with pytest.raises(ValueError, match=field):
            ScoringWeights(**{field: -1.0})

    def test_tier_weights_are_data(self) -> None:
        """Each tier below the GPU is credited at its weight in ``tier_weights``, by ``Tier``;
        one missing, or negative, is refused by its name."""
        weights = {**DEFAULT_TIER_WEIGHTS, Tier.REMOTE: 0.5}
        scorer = Scorer(ScoringWeights(tier_weights=weights), block_size=16)
        overlap = TierOverlap.of({Tier.GPU: 2, Tier.REMOTE: 6})
        assert overlap.depths[Tier.REMOTE] == 6 and overlap.longest == 6
        assert scorer.credit_blocks(overlap) == 1.0 * 2 + 0.5 * 4
        with pytest.raises(ValueError, match="disk_weight"):
            ScoringWeights(tier_weights={**weights, Tier.DISK: -1.0})
        with pytest.raises(ValueError, match=r"below the GPU .* got host, remote"):
            ScoringWeights(tier_weights={Tier.HOST: 1.0, Tier.REMOTE: 1.0})


class TestSelection:
    def test_argmin(self) -> None:
        """At temperature 0 the lowest cost wins."""
        scorer = Scorer(ScoringWeights(), 16, random.Random(0))
        placement = scorer.place([cand("a", decode=10), cand("b", gpu=4), cand("c", decode=3)], 64)
        assert placement is not None and placement.worker_id == "b"
        assert placement.overlap.gpu == 4

    def test_ties_prefer_overlap_then_random(self) -> None:
        """Equal costs go to the deeper overlap; fully equal ones spread uniformly."""
        scorer = Scorer(ScoringWeights(), 16, random.Random(0))
        # a: 4 blocks cached but 4 more decode blocks → same cost as b.
        tied = [cand("a", gpu=4, decode=4 + 8), cand("b", decode=8)]
        assert scorer.cost(tied[0], 128) == scorer.cost(tied[1], 128)
        assert {scorer.place(tied, 128).worker_id for _ in range(50)} == {"a"}  # type: ignore[union-attr]
        equal = [cand("x"), cand("y"), cand("z")]
        picks = Counter(scorer.place(equal, 64).worker_id for _ in range(3000))  # type: ignore[union-attr]
        assert set(picks) == {"x", "y", "z"} and min(picks.values()) > 800

    def test_temperature_samples_by_normalized_cost(self) -> None:
        """At T > 0 cheaper workers are chosen more often, but not always."""
        scorer = Scorer(ScoringWeights(temperature=0.5), 16, random.Random(1))
        cands = [cand("cheap"), cand("dear", decode=100)]
        picks = Counter(scorer.place(cands, 16).worker_id for _ in range(4000))  # type: ignore[union-attr]
        # p(dear)/p(cheap) = exp(-1/0.5) ≈ 0.135
        ratio = picks["dear"] / picks["cheap"]
        assert 0.09 < ratio < 0.19

    def test_no_candidates(self) -> None:
        """No candidate → None."""
        assert Scorer(ScoringWeights(), 16).place([], 10) is None


class TestPools:
    def test_prefill_pool_ignores_decode_load(self) -> None:
        """The prefill pool scores overlap and prefill load only."""
        scorer = Scorer(ScoringWeights(), 16, random.Random(0))
        cands = [cand("a", gpu=8, decode=1000), cand("b", decode=0)]
        assert scorer.place(cands, 256, Pool.PREFILL).worker_id == "a"  # type: ignore[union-attr]
        assert scorer.place(cands, 256, Pool.AGGREGATED).worker_id == "b"  # type: ignore[union-attr]

    def test_decode_pool_by_fullness_and_backpressure(self) -> None:
        """The decode pool picks the emptiest worker relative to capacity; full → None."""
        scorer = Scorer(ScoringWeights(), 16, random.Random(0))
        cands = [cand("big", decode=500, capacity=2000), cand("small", decode=300, capacity=400)]
        assert scorer.place(cands, 16, Pool.DECODE).worker_id == "big"  # type: ignore[union-attr]
        full = [cand("f", decode=401, capacity=400)]
        assert scorer.place(full, 16, Pool.DECODE) is None
