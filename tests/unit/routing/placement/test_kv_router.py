"""The assembled routing core: placement behaviour the gateway relies on."""

from __future__ import annotations

import random
from collections import Counter

from kvcore import BlockHasher, Namespace
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from routing.placement.decode_price import DecodePrice, ItlModel
from routing.placement.kv_router import KvRouter
from routing.placement.pending import PendingPrefixes
from routing.placement.scorer import ScoringWeights

HASHER = BlockHasher(16)
SEED = Namespace("m").seed
WORKERS = ["w0", "w1", "w2", "w3"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def prompt(n_blocks: int, salt: int, tail: int = 0) -> tuple[list[int], list[int]]:
    tokens = [salt * 7919 + i for i in range(16 * n_blocks + tail)]
    return tokens, HASHER.hash_tokens(tokens, SEED)


class TestPlacement:
    def test_prefix_holder_wins(self) -> None:
        """A request goes to the worker whose cache holds its prefix."""
        router = KvRouter(rng=random.Random(0))
        tokens, hashes = prompt(32, 1)
        router.apply(BlockStored("w2", 0, 1, Tier.GPU, hashes[:30]))
        placement = router.place(hashes, len(tokens), WORKERS)
        assert placement is not None and placement.worker_id == "w2"
        assert placement.overlap.gpu == 30

    def test_back_to_back_identical_prompts_do_not_scatter(self) -> None:
        """Identical prompts routed before any event arrives all land on one worker."""
        clock = Clock()
        router = KvRouter(rng=random.Random(3), clock=clock)
        tokens, hashes = prompt(20, 2, tail=7)  # a partial last block must not tip it
        picks = []
        for i in range(8):
            placement = router.place(hashes, len(tokens), WORKERS)
            assert placement is not None
            router.dispatch(f"r{i}", placement, hashes, len(tokens))
            picks.append(placement.worker_id)
        assert len(set(picks)) == 1

    def test_equal_overlap_spreads_by_load(self) -> None:
        """Distinct prompts with no cache anywhere spread over the workers."""
        router = KvRouter(rng=random.Random(0))
        picks: Counter[str] = Counter()
        for i in range(40):
            tokens, hashes = prompt(8, 100 + i)
            placement = router.place(hashes, len(tokens), WORKERS)
            assert placement is not None
            router.dispatch(f"r{i}", placement, hashes, len(tokens))
            picks[placement.worker_id] += 1
        assert set(picks.values()) == {10}

    def test_speculation_expires(self) -> None:
        """A routed prefix stops counting as cached after the TTL without a confirming event."""
        clock = Clock()
        router = KvRouter(rng=random.Random(0), clock=clock, speculative_ttl_s=1.0)
        tokens, hashes = prompt(10, 3)
        placement = router.place(hashes, len(tokens), WORKERS)
        router.dispatch("r", placement, hashes, len(tokens))  # type: ignore[arg-type]
        router.load.finish("r")
        chosen = placement.worker_id  # type: ignore[union-attr]
        assert router.candidates(hashes, [chosen])[0].overlap.gpu == 10
        clock.now += 1.5
        assert router.candidates(hashes, [chosen])[0].overlap.gpu == 0

    def test_confirming_event_replaces_speculation(self) -> None:
        """Once the stored event arrives the pending entry goes; an eviction is then seen."""
        clock = Clock()
        router = KvRouter(rng=random.Random(0), clock=clock, speculative_ttl_s=60.0)
        tokens, hashes = prompt(10, 4)
        placement = router.place(hashes, len(tokens), ["w0"])
        router.dispatch("r", placement, hashes, len(tokens))  # type: ignore[arg-type]
        router.apply(BlockStored("w0", 0, 1, Tier.GPU, hashes))
        router.apply(BlockRemoved("w0", 0, 2, Tier.GPU, hashes[5:]))
        assert router.candidates(hashes, ["w0"])[0].overlap.gpu == 5

    def test_cleared_cache_drops_speculation(self) -> None:
        """A GPU clear (a restarted engine) drops the worker's speculative prefixes too."""
        clock = Clock()
        router = KvRouter(rng=random.Random(0), clock=clock, speculative_ttl_s=60.0)
        tokens, hashes = prompt(10, 7)
        for i, worker in enumerate(["w0", "w1"]):
            placement = router.place(hashes, len(tokens), [worker])
            router.dispatch(f"r{i}", placement, hashes, len(tokens))  # type: ignore[arg-type]
        router.apply(AllBlocksCleared("w0", 0, 1, Tier.HOST))
        assert router.candidates(hashes, ["w0"])[0].overlap.gpu == 10
        router.apply(AllBlocksCleared("w0", 0, 2, Tier.GPU))
        overlaps = [c.overlap.gpu for c in router.candidates(hashes, ["w0", "w1"])]
        assert overlaps == [0, 10]

    def test_dead_worker_leaves_placement(self) -> None:
        """remove_worker drops the worker's blocks and returns its in-flight requests."""
        router = KvRouter(rng=random.Random(0))
        tokens, hashes = prompt(10, 5)
        router.apply(BlockStored("w1", 0, 1, Tier.GPU, hashes))
        placement = router.place(hashes, len(tokens), WORKERS)
        router.dispatch("r", placement, hashes, len(tokens))  # type: ignore[arg-type]
        assert router.remove_worker("w1") == ["r"]
        placement = router.place(hashes, len(tokens), [w for w in WORKERS if w != "w1"])
        assert placement is not None and placement.overlap.gpu == 0

    def test_exclude_gives_next_best(self) -> None:
        """Excluding the best worker (a failed attempt) yields the next best."""
        router = KvRouter(rng=random.Random(0))
        tokens, hashes = prompt(10, 6)
        router.apply(BlockStored("w0", 0, 1, Tier.GPU, hashes))
        router.apply(BlockStored("w1", 0, 1, Tier.GPU, hashes[:6]))
        assert router.place(hashes, len(tokens), WORKERS, exclude={"w0"}).worker_id == "w1"  # type: ignore[union-attr]


def first_wave(seed: int, speculative_ttl_s: float) -> set[tuple[str, int]]:
    """64 requests of one of two 4,000-token system prompts (+64 tokens each) placed 10 ms
    apart on four cold workers, before any stored event: the hot load's first burst
    (docs/bench/goodput.md), with the weights and decode price the gateway had learned by
    the end of that run. Returns the (worker, prompt) pairs it placed: each a cold prefill
    of that system prompt on that worker."""
    clock = Clock()
    scale, prefill_s_per_token = 5.0, 3.8e-5
    router = KvRouter(weights=ScoringWeights(overlap_weight=19.0, prefill_load_scale=scale),
                      rng=random.Random(seed), clock=clock, speculative_ttl_s=speculative_ttl_s)
    router.scorer.decode = DecodePrice(ItlModel(0.042, 0.0018), 66.0, prefill_s_per_token,
                                       scale / (16 * prefill_s_per_token), itl_target_s=0.2)
    rng = random.Random(seed)
    systems = [[p * 100_000 + i for i in range(4000)] for p in range(2)]
    cold: set[tuple[str, int]] = set()
    for i in range(64):
        system = rng.randrange(2)
        tokens = systems[system] + [900_000 + i * 100 + j for j in range(64)]
        hashes = HASHER.hash_tokens(tokens, SEED)
        placement = router.place(hashes, len(tokens), WORKERS)
        assert placement is not None
        router.dispatch(f"r{i}", placement, hashes, len(tokens))
        cold.add((placement.worker_id, system))
        clock.now += 0.01
    return cold


class TestFirstWave:
    def test_a_prefix_being_prefilled_draws_its_followers(self) -> None:
        """A burst for two hot prompts on cold workers computes at most one prompt a worker:
        a prompt placed but not yet stored counts as held where it went (speculation), so its
        followers go there rather than start a second cold prefill elsewhere. (How many
        workers take each prompt is the load price's call: with the ITL target far off, as
        here, it may keep each prompt on one worker.)"""
        for seed in range(8):
            cold = first_wave(seed, speculative_ttl_s=2.0)
            per_worker = Counter(w for w, _ in cold)
            assert max(per_worker.values()) == 1 and len(cold) <= len(WORKERS), cold
            assert {system for _, system in cold} == {0, 1}, cold

    def test_without_speculation_the_wave_computes_both_prompts_nearly_everywhere(
        self,
    ) -> None:
        """The control: were the placements forgotten before the next one (speculation
        expiring within the 10 ms between requests), load would spread each prompt over
        most workers."""
        assert min(len(first_wave(seed, speculative_ttl_s=0.005)) for seed in range(8)) >= 7


class TestPending:
    def test_record_overlapping_prefixes(self) -> None:
        """Recording overlapping prefixes keeps each worker's pending set prefix-closed."""
        pending = PendingPrefixes(ttl_s=10)
        _, a = prompt(8, 7)
        pending.record("w", a[:3], now=0)
        pending.record("w", a, now=5)
        assert pending.match(a, now=12) == {"w": 8}  # first entry expired, second refreshed 0..2
        assert pending.match(a, now=16) == {}
