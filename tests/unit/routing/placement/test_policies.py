"""Placement policies over the routing core."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

from kvcore import BlockHasher, Namespace
from kvcore.events import AllBlocksCleared, BlockStored, Tier
from routing.config import RouterMode
from routing.flags import gateway_config
from routing.placement.kv_router import KvRouter
from routing.placement.policies import make_policy
from routing.serve.gateway import Gateway

WORKERS = ["w0", "w1", "w2"]
MODEL = Path(__file__).resolve().parents[4] / "refengine" / "models" / "tiny"


def _hashes(tokens: list[int]) -> list[int]:
    return BlockHasher(16).hash_tokens(tokens, Namespace("m").seed)


def test_round_robin_cycles_and_skips_excluded() -> None:
    """Round-robin visits every worker in turn; an excluded worker is skipped."""
    policy = make_policy(RouterMode.ROUND_ROBIN, KvRouter(), random.Random(0))
    picks = [policy.choose((), 0, WORKERS, ()).worker_id for _ in range(6)]  # type: ignore[union-attr]
    assert Counter(picks) == {"w0": 2, "w1": 2, "w2": 2}
    assert all(policy.choose((), 0, WORKERS, {"w1"}).worker_id != "w1" for _ in range(5))  # type: ignore[union-attr]
    assert policy.choose((), 0, WORKERS, set(WORKERS)) is None


def test_least_loaded_prefers_fewest_in_flight() -> None:
    """Least-loaded picks the worker with the fewest in-flight requests."""
    router = KvRouter()
    policy = make_policy(RouterMode.LEAST_LOADED, router, random.Random(0))
    for i in range(4):
        placement = policy.choose((), 10, WORKERS, ())
        assert placement is not None
        router.dispatch(f"r{i}", placement, (), 10)
    counts = Counter(router.load.worker_of(f"r{i}") for i in range(4))
    assert sorted(counts.values()) == [1, 1, 2]
    router.load.finish("r0")
    router.load.finish("r1")
    busiest = max(counts, key=lambda w: counts[w])
    placement = policy.choose((), 10, WORKERS, ())
    assert placement is not None and placement.worker_id != busiest


def test_approx_keeps_a_repeated_prefix_together() -> None:
    """Prefix-aware placement sends requests sharing a long prefix to the same worker."""
    router = KvRouter(speculative_ttl_s=60.0, rng=random.Random(0))
    policy = make_policy(RouterMode.APPROX, router, random.Random(0))
    rng = random.Random(1)
    shared = [rng.randrange(1000) for _ in range(512)]
    chosen = set()
    for i in range(8):
        tokens = shared + [rng.randrange(1000) for _ in range(32)]
        hashes = _hashes(tokens)
        placement = policy.choose(hashes, len(tokens), WORKERS, ())
        assert placement is not None
        if i:
            assert placement.overlap.gpu >= len(shared) // 16
        chosen.add(placement.worker_id)
        router.dispatch(f"r{i}", placement, hashes, len(tokens))
        router.load.finish(f"r{i}")
    assert len(chosen) == 1


def test_random_uses_every_worker() -> None:
    """Random placement reaches every worker."""
    policy = make_policy(RouterMode.RANDOM, KvRouter(), random.Random(3))
    picks = {policy.choose((), 0, WORKERS, ()).worker_id for _ in range(60)}  # type: ignore[union-attr]
    assert picks == set(WORKERS)


def _gateway(mode: str) -> Gateway:
    """A gateway with a sidecar (never contacted: nothing here starts it)."""
    return Gateway(gateway_config(["--sidecar", "http://127.0.0.1:9", "--router-mode", mode,
                                   "--model-path", str(MODEL)]))


def test_approx_with_sidecars_predicts_from_its_own_placements() -> None:
    """With sidecars, approx ignores their events and places by its own recent placements
    (kept --approx-ttl-s), where kv takes the events as they come."""
    tokens = list(range(160))
    hashes = _hashes(tokens)
    stored = BlockStored("w2", 0, 1, Tier.GPU, hashes)
    kv, approx = _gateway("kv"), _gateway("approx")
    for gw in (kv, approx):
        gw.router.apply(stored)
    seen = kv.ctx.policy.choose(hashes, len(tokens), WORKERS, ())
    assert seen is not None and seen.worker_id == "w2" and seen.overlap.gpu == len(hashes)
    placed = approx.ctx.policy.choose(hashes, len(tokens), WORKERS, ())
    assert placed is not None and placed.overlap.longest == 0  # w2's event is not an overlap
    assert approx.router.pending.ttl_s == approx.cfg.approx_ttl_s
    approx.router.dispatch("r0", placed, hashes, len(tokens))
    approx.router.load.finish("r0")
    # The worker's sidecar says it holds nothing: approx keeps its prediction all the same.
    approx.router.apply(AllBlocksCleared(placed.worker_id, 0, 2, Tier.GPU))
    again = approx.ctx.policy.choose(hashes, len(tokens), WORKERS, ())
    assert again is not None and again.worker_id == placed.worker_id
    assert again.overlap.gpu == len(hashes)
