"""Decode interference: the ITL fit learned from relayed token gaps, and what it does to
placement of a hot prefix."""

from __future__ import annotations

import random

import pytest

from kvcore import BlockHasher, Namespace
from kvcore.events import BlockStored, Tier
from routing.placement.decode_price import DecodePrice, ItlModel
from routing.placement.interference import DecodeInterference
from routing.placement.kv_router import KvRouter
from routing.placement.scorer import (
    Candidate,
    Reason,
    Scorer,
    ScoringWeights,
    TierOverlap,
    WorkerLoad,
)
from routing.placement.tuning import WeightTuner

BS = 16
HASHER = BlockHasher(BS)
SEED = Namespace("m").seed
WORKERS = ["w0", "w1", "w2", "w3"]
HOT_BLOCKS = 250  # a 4,000-token system prompt
OUTPUT = 64  # tokens each request streams


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def feed_ttft(tuner: WeightTuner, n: int = 64, a: float = 20e-6, c: float = 2e-6) -> None:
    """TTFT samples of ``5 ms + a·prefill tokens + c·decode blocks`` (the prefill rate)."""
    rng = random.Random(7)
    for i in range(n):
        p, d = rng.randrange(0, 8000), rng.randrange(0, 3000)
        tuner.dispatched(f"ttft{i}", p, d, 0.0)
        tuner.first_token(f"ttft{i}", 0.005 + a * p + c * d)


def learner(weight: float = 1.0, target_s: float = 0.05) -> tuple[Scorer, DecodeInterference]:
    scorer = Scorer(ScoringWeights(prefill_load_scale=10.0), BS)
    tuner = WeightTuner(scorer, fixed_overlap=1.0, fixed_scale=10.0, fit_ttft=True)
    feed_ttft(tuner)
    clock = Clock()
    return scorer, DecodeInterference(scorer, tuner, itl_target_s=target_s, weight=weight,
                                      clock=clock)


class TestFit:
    def test_no_price_before_any_gap(self) -> None:
        """TTFT alone never prices decode: with no token gaps the scorer has no decode term."""
        scorer, learn = learner()
        learn.finished(OUTPUT)
        learn.refit()
        assert scorer.decode is None

    def test_converges_on_each_workers_itl_line(self) -> None:
        """Noisy gaps of ``base + per_stream·n`` per worker: the fit recovers each line."""
        scorer, learn = learner()
        truth = {"w0": ItlModel(0.004, 0.0019), "w1": ItlModel(0.010, 0.0030)}
        rng = random.Random(1)
        for _ in range(4000):
            wid = rng.choice(list(truth))
            n = rng.randrange(1, 40)
            gap = truth[wid].itl(n) * rng.uniform(0.9, 1.1)
            learn.token_gap(wid, n, gap, 1)
        learn.finished(OUTPUT)
        learn.refit()
        price = scorer.decode
        assert price is not None
        for wid, model in truth.items():
            fitted = price.model(wid)
            assert fitted.per_stream_s == pytest.approx(model.per_stream_s, rel=0.1)
            assert fitted.itl(16) == pytest.approx(model.itl(16), rel=0.05)
        assert price.prefill_s_per_token == pytest.approx(20e-6, rel=0.05)
        assert price.output_tokens == pytest.approx(OUTPUT)

    def test_a_worker_at_one_batch_size_takes_the_fleets_slope(self) -> None:
        """A worker always at 16 streams cannot show a slope of its own: the fleet's slope
        goes through its own mean, so its level is still its own."""
        scorer, learn = learner()
        rng = random.Random(2)
        for _ in range(3000):
            n = rng.randrange(1, 40)
            learn.token_gap("w1", n, 0.004 + 0.002 * n, 1)
            learn.token_gap("w0", 16, 0.010 + 0.002 * 16, 1)  # slower at the same slope
        learn.finished(OUTPUT)
        learn.refit()
        assert scorer.decode is not None
        w0 = scorer.decode.model("w0")
        assert w0.per_stream_s == pytest.approx(0.002, rel=0.05)
        assert w0.base_s == pytest.approx(0.010, rel=0.05)
        assert scorer.decode.model("unseen") == scorer.decode.fleet

    def test_weight_zero_prices_nothing(self) -> None:
        """``--decode-interference-weight 0`` is the prefill-only cost."""
        scorer, learn = learner(weight=0.0)
        for n in range(1, 200):
            learn.token_gap("w0", n % 40, 0.004 + 0.002 * (n % 40), 1)
        learn.finished(OUTPUT)
        learn.refit()
        assert scorer.decode is None


class TestPrice:
    """The price is the time past the ITL target; 0 while the target holds."""

    @staticmethod
    def price(per_token: float = 20e-6) -> DecodePrice:
        return DecodePrice(fleet=ItlModel(0.004, 0.002), output_tokens=64,
                           prefill_s_per_token=per_token, units_per_s=1.0, itl_target_s=0.05)

    def test_nothing_while_the_itl_target_holds(self) -> None:
        """16 streams at 4 + 2·17 = 38 ms, under the 50 ms target: one more stream there
        costs no one a target, whatever it slows (the cut that charged this herded the
        pressure load's misses onto cold workers)."""
        price = self.price()
        assert price.model("w").itl(17) < 0.05
        assert [price.seconds("w", n, 64) for n in (0, 8, 16)] == [0.0, 0.0, 0.0]

    def test_overshooting_the_target_costs_in_proportion(self) -> None:
        """Past the target the price is the overshoot times the tokens still to come: the
        request's own 64 and half of each stream's already there."""
        price = self.price()
        n = 30  # ITL 4 + 2·31 = 66 ms: 16 ms over
        assert price.seconds("w", n, 0) == pytest.approx(0.016 * 64 * (1 + n / 2))
        costs = [price.seconds("w", n, 0) for n in (30, 31, 32)]
        assert costs[2] - costs[1] > costs[1] - costs[0] > 0  # how far and how many

    def test_an_uncached_prompt_counts_only_if_it_pushes_past_the_target(self) -> None:
        """Prefilling 4,000 tokens stalls each stream 80 ms once, 1.25 ms a token over 64:
        at 22 streams (ITL 50 ms) that crosses the target, at 16 (38 ms) it does not."""
        price = self.price()
        assert price.seconds("w", 16, 4000) == 0.0
        assert price.seconds("w", 22, 0) == 0.0
        assert price.seconds("w", 22, 4000) == pytest.approx(
            (0.050 + 20e-6 * 4000 / 64 - 0.05) * 64 * (1 + 22 / 2))

    def test_a_new_prefix_the_term_sends_elsewhere_counts_as_a_move(self) -> None:
        """No worker holds the prompt: without the term the worker holding fewer blocks
        wins; with it the one with fewer streams does. The reason reads ``best`` (no deeper
        holder was passed over), but the move is counted, since it decides where the new
        prefix is cached."""
        scorer = Scorer(ScoringWeights(prefill_load_scale=10.0), BS)
        busy = Candidate("w0", TierOverlap(0), WorkerLoad(0, 100, 30))  # ITL 66 ms there
        held = Candidate("w1", TierOverlap(0), WorkerLoad(0, 110, 2))
        placement = scorer.place([busy, held], 256)
        assert placement is not None and placement.worker_id == "w0"
        scorer.decode = self.price()
        placement = scorer.place([busy, held], 256)
        assert placement is not None and placement.worker_id == "w1"
        assert placement.reason == Reason.BEST
        assert scorer.decode_moves == 1
        placement = scorer.place([held, busy], 256)  # the same choice again, in either order
        assert scorer.decode_moves == 2

    def test_a_worker_whose_pool_the_request_would_overfill_has_no_decode_term(self) -> None:
        """Past its KV capacity a request waits for memory and joins the batch only as
        another leaves: it slows no step there, so the busy worker of the test above keeps
        the request it would win without the term (the capacity load's moves off a full
        holder cost 3 % of its hit rate, docs/bench/goodput.md)."""
        scorer = Scorer(ScoringWeights(prefill_load_scale=10.0), BS)
        scorer.decode = self.price()
        full = Candidate("w0", TierOverlap(0), WorkerLoad(0, 100, 30, capacity_blocks=64))
        held = Candidate("w1", TierOverlap(0), WorkerLoad(0, 110, 2, capacity_blocks=1024))
        placement = scorer.place([full, held], 256)
        assert placement is not None and placement.worker_id == "w0"
        assert scorer.decode_moves == 0
        roomy = Candidate("w0", TierOverlap(0), WorkerLoad(0, 100, 30, capacity_blocks=100))
        placement = scorer.place([roomy, held], 256)  # exactly full: it joins the batch
        assert placement is not None and placement.worker_id == "w1"

    def test_a_cached_prefix_outweighs_balance_under_the_target(self) -> None:
        """The pressure load's shape (bench_pressure at 1,024 blocks: the fit read off a
        run's /v1/workers, 12 ms + 1.5 ms a stream, a TTFT fit of 345 µs a token that counts
        queueing): a worker holding the 2,000-token system prompt with 20 streams wins over
        an idle worker that would compute it, since neither misses the 100 ms target."""
        scorer = Scorer(ScoringWeights(overlap_weight=19.5, prefill_load_scale=1.33), BS)
        per_token = 345e-6
        scorer.decode = DecodePrice(
            fleet=ItlModel(0.012, 0.0015), output_tokens=66, prefill_s_per_token=per_token,
            units_per_s=1.33 / (BS * per_token), itl_target_s=0.1)
        prompt = 2064
        holder = Candidate("w0", TierOverlap(125), WorkerLoad(0, 20 * 130, 20))
        idle = Candidate("w1", TierOverlap(0), WorkerLoad(0, 0, 0))
        placement = scorer.place([holder, idle], prompt)
        assert placement is not None
        assert placement.worker_id == "w0" and placement.reason == Reason.BEST


def hot_fleet(weight: float, itl: ItlModel, clock: Clock) -> tuple[KvRouter, list[int], int]:
    """Four workers; w0 holds a hot 4,000-token prefix and streams 30 requests of it, the
    others stream a few unrelated ones. Every stream's 60 tokens come ``itl`` of its
    worker's batch apart; then all but 15 of the holder's finish. Returns the router and a
    new request for the hot prefix."""
    router = KvRouter(rng=random.Random(0), clock=clock,
                      weights=ScoringWeights(prefill_load_scale=10.0),
                      decode_interference_weight=weight, itl_target_s=0.05)
    if router.tuner is not None:
        feed_ttft(router.tuner)
    hot = [1_000_003 + i for i in range(HOT_BLOCKS * BS)]
    hot_hashes = HASHER.hash_tokens(hot, SEED)
    router.apply(BlockStored("w0", 0, 1, Tier.GPU, hot_hashes))
    streams: dict[str, list[str]] = {}
    counts = {"w0": 30, "w1": 3, "w2": 6, "w3": 1}
    for wid, n in counts.items():
        for i in range(n):
            rid = f"{wid}-{i}"
            tokens = hot + [i] * 64 if wid == "w0" else [hash((wid, i)) % 30000] * 128
            hashes = HASHER.hash_tokens(tokens, SEED)
            placement = router.place(hashes, len(tokens), [wid])
            assert placement is not None
            router.dispatch(rid, placement, hashes, len(tokens))
            streams.setdefault(wid, []).append(rid)
    start = clock.now
    ticks = sorted(  # each worker's streams advance one token per ITL of its batch
        (start + k * itl.itl(len(rids)), rid)
        for rids in streams.values() for rid in rids for k in range(60)
    )
    for at, rid in ticks:
        clock.now = at
        router.load.tokens_generated(rid)
    held = streams["w0"][:15]  # 15 go on on the holder; the rest finish
    for rids in streams.values():
        for rid in rids:
            if rid not in held:
                router.load.finish(rid)
    if router.interference is not None:
        router.interference.refit()
    request = hot + [424242] * 64
    return router, HASHER.hash_tokens(request, SEED), len(request)


class TestHotPrefix:
    def test_spreads_when_the_holder_decodes_slowly(self) -> None:
        """15 streams at 1.9 ms each put the holder's next ITL past the target: the hot
        request goes to an idle worker and recomputes the prefix there."""
        clock = Clock()
        router, hashes, tokens = hot_fleet(1.0, ItlModel(0.004, 0.0030), clock)
        assert router.scorer.decode is not None
        assert router.scorer.decode.model("w0").itl(16) > 0.05
        placement = router.place(hashes, tokens, WORKERS)
        assert placement is not None
        assert placement.worker_id != "w0"
        assert placement.reason == Reason.INTERFERENCE
        assert router.scorer.decode_moves == 1

    def test_without_the_term_the_holder_takes_it(self) -> None:
        """Today's prefill-only cost (weight 0) sends the same request to the holder."""
        clock = Clock()
        router, hashes, tokens = hot_fleet(0.0, ItlModel(0.004, 0.0030), clock)
        assert router.scorer.decode is None
        placement = router.place(hashes, tokens, WORKERS)
        assert placement is not None and placement.worker_id == "w0"
        assert router.scorer.decode_moves == 0

    def test_keeps_affinity_when_streams_do_not_interfere(self) -> None:
        """When the holder's ITL does not grow with its batch, the prefix stays where it is
        cached."""
        clock = Clock()
        router, hashes, tokens = hot_fleet(1.0, ItlModel(0.006, 0.0), clock)
        assert router.scorer.decode is not None
        assert router.scorer.decode.fleet.per_stream_s == pytest.approx(0.0, abs=1e-6)
        placement = router.place(hashes, tokens, WORKERS)
        assert placement is not None and placement.worker_id == "w0"

    def test_a_requests_own_itl_target_is_priced(self) -> None:
        """x-kvsidecar-slo-itl-ms reaches the overshoot term: at a flat 30 ms ITL the holder
        meets the gateway's 50 ms target and keeps the request, but not one asking for 20 ms;
        at 60 ms it misses the gateway's, yet meets a request's 1 s."""
        router, hashes, tokens = hot_fleet(1.0, ItlModel(0.030, 0.0), Clock())
        assert router.place(hashes, tokens, WORKERS).worker_id == "w0"  # type: ignore[union-attr]
        tight = router.place(hashes, tokens, WORKERS, itl_target_s=0.020)
        assert tight is not None and tight.worker_id != "w0"
        assert tight.reason == Reason.INTERFERENCE
        router, hashes, tokens = hot_fleet(1.0, ItlModel(0.060, 0.0), Clock())
        assert router.place(hashes, tokens, WORKERS).worker_id != "w0"  # type: ignore[union-attr]
        loose = router.place(hashes, tokens, WORKERS, itl_target_s=1.0)
        assert loose is not None and loose.worker_id == "w0"
