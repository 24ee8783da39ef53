"""Self-tuning weights: the scorer's overlap weight and prefill scale follow the feedback."""

from __future__ import annotations

import random

import pytest

from kvcore.events import BlockRemoved, BlockStored, Tier
from routing.placement.kv_router import KvRouter
from routing.placement.scorer import Scorer, ScoringWeights
from routing.placement.tuning import LOCALITY, SCALE_PRIOR, SCALE_RANGE, WeightTuner

BS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def feed_ttft(tuner: WeightTuner, n: int, a: float, c: float, seed: int = 0) -> None:
    """``n`` placements whose TTFT is 5 ms + ``a``·prefill tokens + ``c``·decode blocks."""
    rng = random.Random(seed)
    for i in range(n):
        p, d = rng.randrange(0, 8000), rng.randrange(0, 3000)
        tuner.dispatched(f"r{i}", p, d, 0.0)
        tuner.first_token(f"r{i}", 0.005 + a * p + c * d)


class TestPrefillLoadScale:
    def test_starts_at_the_prior(self) -> None:
        """Before any feedback the scorer runs with the prior scale and overlap weight 1."""
        scorer = Scorer(ScoringWeights(), BS)
        WeightTuner(scorer)
        assert (scorer.weights.prefill_load_scale, scorer.weights.overlap_weight) == (
            SCALE_PRIOR,
            1.0,
        )

    def test_learns_the_price_of_prefill_against_decode(self) -> None:
        """The scale converges on a·block_size/c of the TTFT the fleet shows."""
        scorer = Scorer(ScoringWeights(), BS)
        tuner = WeightTuner(scorer)
        feed_ttft(tuner, 400, a=20e-6, c=4e-6)  # a prefill block costs 80 decode blocks
        assert scorer.weights.prefill_load_scale == pytest.approx(80.0, rel=0.05)

    def test_decode_free_ttft_pins_the_scale_high(self) -> None:
        """When decode load does not show in TTFT, prefill is all that counts."""
        scorer = Scorer(ScoringWeights(), BS)
        tuner = WeightTuner(scorer)
        feed_ttft(tuner, 400, a=20e-6, c=0.0)
        assert scorer.weights.prefill_load_scale == pytest.approx(SCALE_RANGE[1], rel=0.05)

    def test_an_operators_scale_is_kept(self) -> None:
        """A fixed scale never moves, whatever the feedback."""
        scorer = Scorer(ScoringWeights(prefill_load_scale=3.0), BS)
        tuner = WeightTuner(scorer, fixed_scale=3.0)
        feed_ttft(tuner, 200, a=20e-6, c=4e-6)
        assert scorer.weights.prefill_load_scale == 3.0


class TestOverlapWeight:
    def test_rises_with_eviction_pressure(self) -> None:
        """Weight 1 while nothing is evicted, 1 + LOCALITY when every store evicts."""
        scorer = Scorer(ScoringWeights(), BS)
        tuner = WeightTuner(scorer)
        tuner.blocks_stored(1000)
        feed_ttft(tuner, 8, a=1e-5, c=1e-6)
        assert scorer.weights.overlap_weight == 1.0
        for _ in range(20):
            tuner.blocks_stored(1000)
            tuner.blocks_removed(1000)
        feed_ttft(tuner, 8, a=1e-5, c=1e-6, seed=1)
        assert scorer.weights.overlap_weight == pytest.approx(1.0 + LOCALITY, rel=0.02)

    def test_an_operators_weight_is_kept(self) -> None:
        """A fixed overlap weight never moves."""
        scorer = Scorer(ScoringWeights(overlap_weight=2.0), BS)
        tuner = WeightTuner(scorer, fixed_overlap=2.0)
        tuner.blocks_stored(100)
        tuner.blocks_removed(100)
        feed_ttft(tuner, 8, a=1e-5, c=1e-6)
        assert scorer.weights.overlap_weight == 2.0


class TestRouterFeedback:
    def test_events_and_first_tokens_reach_the_tuner(self) -> None:
        """The router feeds its tuner from events, dispatches and first tokens."""
        clock = Clock()
        router = KvRouter(
            block_size=BS,
            rng=random.Random(0),
            clock=clock,
            learn_overlap_weight=True,
            learn_prefill_load_scale=True,
        )
        assert router.tuner is not None
        router.apply(BlockStored("w0", 0, 1, Tier.GPU, [1, 2, 3, 4]))
        router.apply(BlockRemoved("w0", 0, 2, Tier.GPU, [3, 4]))
        assert router.tuner.pressure == pytest.approx(0.5, rel=0.01)
        rng = random.Random(0)
        for i in range(64):
            blocks = [10_000 + i * 100 + j for j in range(rng.randrange(1, 40))]
            placement = router.place(blocks, len(blocks) * BS, ["w0", "w1"])
            assert placement is not None
            router.dispatch(f"r{i}", placement, blocks, len(blocks) * BS)
            clock.now += 0.001 * len(blocks)  # TTFT: the request's own prefill only
            router.load.first_token(f"r{i}")
            if i % 3:  # the others stay, decoding: decode load that TTFT does not show
                router.load.finish(f"r{i}")
        assert router.scorer.weights.overlap_weight == pytest.approx(1.0 + LOCALITY * 0.5)
        assert router.scorer.weights.prefill_load_scale > 5 * SCALE_PRIOR

    def test_fixed_weights_make_no_tuner(self) -> None:
        """Without learning the router keeps the weights it was given."""
        router = KvRouter(weights=ScoringWeights(overlap_weight=3.0))
        assert router.tuner is None
        assert router.scorer.weights.overlap_weight == 3.0
