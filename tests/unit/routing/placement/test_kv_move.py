"""The pull option: a lighter worker pulls a busy holder's prefix instead of herding."""

from __future__ import annotations

import random

import pytest

from kvcore import BlockHasher, Namespace
from kvcore.events import BlockStored, Tier
from routing.placement.kv_move import RATIO_PRIOR, MovePlanner, PullReport, parse_pull
from routing.placement.kv_router import KvRouter
from routing.placement.scorer import Candidate, Pool, Reason, TierOverlap, WorkerLoad
from sidecar.kv_move import MoveOutcome

HASHER = BlockHasher(16)
SEED = Namespace("m").seed
PROMPT = list(range(16 * 10))
HASHES = HASHER.hash_tokens(PROMPT, SEED)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fleet(clock: Clock | None = None, moves: bool = True) -> KvRouter:
    """w0 holds the prompt on its GPU and in its store; w1 and w2 have stores (each holds
    some other block there); w3 has none."""
    router = KvRouter(block_size=16, rng=random.Random(0), clock=clock or Clock())
    if moves:
        router.enable_moves()
    router.apply(BlockStored("w0", 0, 1, Tier.GPU, HASHES))
    router.apply(BlockStored("w0", 0, 2, Tier.HOST, HASHES))
    for seq, worker in enumerate(("w1", "w2")):
        other = HASHER.hash_tokens([7_000 + seq] * 16, SEED)
        router.apply(BlockStored(worker, 0, 1, Tier.HOST, other))
    return router


def overload(router: KvRouter, worker: str, blocks: int = 40) -> None:
    """``blocks`` blocks of other requests' prefill queued on ``worker``."""
    busy = HASHER.hash_tokens([10_000 + i for i in range(16 * blocks)], SEED)
    router.load.add(f"held-{worker}", worker, busy, 16 * blocks, 0)


class TestPlacement:
    def test_an_overloaded_holder_s_prefix_moves_to_a_light_worker(self) -> None:
        """The holder's queue outweighs its cached prefix: a light worker with a store is
        chosen, told to pull the 10 blocks from the holder, and predicted to hold them."""
        router = fleet()
        overload(router, "w0")
        placement = router.place(HASHES, len(PROMPT), ["w0", "w1", "w3"])
        assert placement is not None
        assert (placement.worker_id, placement.reason, placement.moved_from) == (
            "w1", Reason.MOVED, "w0")
        assert placement.overlap == TierOverlap(0, 10, 0, 0)
        assert router.move is not None and router.move.num_planned == 1

    def test_without_moves_the_light_worker_recomputes(self) -> None:
        """--kv-move off: the same fleet sends it to the light worker with nothing cached."""
        router = fleet(moves=False)
        overload(router, "w0")
        placement = router.place(HASHES, len(PROMPT), ["w0", "w1"])
        assert placement is not None
        assert (placement.worker_id, placement.reason, placement.moved_from) == (
            "w1", Reason.LOAD, None)
        assert placement.overlap.longest == 0

    def test_a_light_holder_keeps_its_prefix(self) -> None:
        """Nothing queued on the holder: its cached prefix wins over any pull."""
        router = fleet()
        placement = router.place(HASHES, len(PROMPT), ["w0", "w1", "w2"])
        assert placement is not None
        assert (placement.worker_id, placement.reason, placement.moved_from) == (
            "w0", Reason.BEST, None)

    def test_a_worker_without_a_store_is_never_told_to_pull(self) -> None:
        """w3's sidecar published no host-tier block: it could not pull; it recomputes."""
        router = fleet()
        overload(router, "w0")
        placement = router.place(HASHES, len(PROMPT), ["w0", "w3"])
        assert placement is not None
        assert (placement.worker_id, placement.moved_from) == ("w3", None)

    def test_a_busy_holder_is_a_source_though_never_chosen(self) -> None:
        """The holder is at its in-flight cap (saturated): its store still serves the pull."""
        router = fleet()
        placement = router.place(HASHES, len(PROMPT), ["w1", "w3"], saturated=["w0"])
        assert placement is not None
        assert (placement.worker_id, placement.reason, placement.moved_from) == (
            "w1", Reason.MOVED, "w0")

    def test_the_decode_pool_never_moves(self) -> None:
        """Only aggregated placement pulls: a decode worker's KV comes from its pair."""
        router = fleet()
        overload(router, "w0")
        placement = router.place(HASHES, len(PROMPT), ["w0", "w1"], pool=Pool.PREFILL)
        assert placement is not None and placement.moved_from is None


    def test_a_move_in_flight_is_joined_not_raced(self) -> None:
        """A second request of the prefix, placed where a move is still bringing it (the
        blocks only predicted there), is told to pull too: its sidecar joins that pull
        instead of letting the engine recompute the blocks not yet committed."""
        router = fleet()
        overload(router, "w0")
        first = router.place(HASHES, len(PROMPT), ["w0", "w1"])
        assert first is not None and first.moved_from == "w0"
        router.dispatch("r1", first, HASHES, len(PROMPT))
        second = router.place(HASHES, len(PROMPT), ["w0", "w1"])
        assert second is not None
        assert (second.worker_id, second.reason, second.moved_from) == (
            "w1", Reason.MOVED, "w0")
        assert second.overlap.depths[Tier.HOST] == 10  # the sidecar is told the whole prefix


class TestPrice:
    def test_the_prior_until_both_speeds_are_measured(self) -> None:
        """No pull reported and no prefill speed fitted: the prior ratio."""
        planner = MovePlanner(16, prefill_s_per_token=lambda: 1e-3)
        assert planner.ratio() == RATIO_PRIOR
        planner = MovePlanner(16)
        planner.reported("w0", PullReport(True, 10, 10 << 15, 0.01))
        assert planner.ratio() == RATIO_PRIOR

    def test_the_ratio_is_pull_time_over_prefill_time_per_block(self) -> None:
        """1 ms per pulled block against 16 tokens × 0.5 ms of prefill: 1/8."""
        planner = MovePlanner(16, prefill_s_per_token=lambda: 5e-4)
        planner.reported("w0", PullReport(True, 10, 10 << 15, 0.01))
        assert planner.ratio() == pytest.approx(0.125)
        assert planner.gbytes_per_s() == pytest.approx((10 << 15) / 0.01 / 1e9)

    def test_a_pull_slower_than_a_prefill_offers_no_move(self) -> None:
        """Pulls measured slower than recomputing: the overloaded holder's load decides
        alone, and the light worker recomputes."""
        router = fleet()
        router.move = MovePlanner(16, prefill_s_per_token=lambda: 1e-4)  # 1.6 ms a block
        router.move.reported("w0", PullReport(True, 1, 32768, 1.0))  # 1 s a block
        overload(router, "w0")
        placement = router.place(HASHES, len(PROMPT), ["w0", "w1"])
        assert placement is not None
        assert (placement.worker_id, placement.moved_from) == ("w1", None)

    def test_a_failed_pull_backs_the_source_off_for_a_while(self) -> None:
        """After a failed pull from w0, no worker is told to pull from it for backoff_s;
        then it is offered again."""
        clock = Clock()
        router = fleet(clock)
        assert router.move is not None
        overload(router, "w0")
        router.move.reported("w0", PullReport(False, 0, 0, 0.002, "peer_unavailable"))
        placement = router.place(HASHES, len(PROMPT), ["w0", "w1"])
        assert placement is not None and placement.moved_from is None
        clock.now += router.move.backoff_s
        placement = router.place(HASHES, len(PROMPT), ["w0", "w1"])
        assert placement is not None and placement.moved_from == "w0"
        assert (router.move.num_failed, router.move.num_moved) == (1, 0)

    def test_candidates_already_as_deep_are_left_alone(self) -> None:
        """A worker holding the prefix as deep as the source's store gets no pull."""
        planner = MovePlanner(16)
        source = Candidate("a", TierOverlap(4, 4), WorkerLoad())
        deep = Candidate("b", TierOverlap(4, 0), WorkerLoad(active_prefill_tokens=3))
        shallow = Candidate("c", TierOverlap(1, 0), WorkerLoad(active_prefill_tokens=3))
        out, plans = planner.offer([source, deep, shallow], [source, deep, shallow])
        assert out[:2] == [source, deep]
        assert out[2].overlap == TierOverlap(1, 4)
        # 3 pulled blocks, each charged RATIO_PRIOR of its 16 tokens of prefill
        assert out[2].load.active_prefill_tokens == 3 + round(3 * 16 * RATIO_PRIOR)
        assert list(plans) == ["c"] and plans["c"].source_id == "a"


class TestReport:
    def test_the_sidecar_s_header_parses(self) -> None:
        """What ``sidecar.kv_move`` writes is what the gateway reads."""
        ok = parse_pull(MoveOutcome(12, 393216, 0.0031).header().encode())
        assert ok == PullReport(True, 12, 393216, 0.0031)
        failed = parse_pull(MoveOutcome(0, 0, 0.5, "peer_unavailable").header().encode())
        assert failed == PullReport(False, 0, 0, 0.5, "peer_unavailable")

    @pytest.mark.parametrize("raw", [b"", b"outcome=ok", b"outcome=ok blocks=x bytes=1 "
                                     b"seconds=1", b"blocks=1 bytes=1 seconds=1",
                                     b"outcome=ok blocks=1 bytes=1 seconds=nan"])
    def test_a_garbled_header_is_no_report(self, raw: bytes) -> None:
        """Anything else is ignored (counted as unreported), never trusted."""
        assert parse_pull(raw) is None
