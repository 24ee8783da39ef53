"""The engine's own load reading in placement: only its surplus over the gateway's count adds
load, it steers the KV cost and least-loaded alike, and the registry hands it on and drops it."""

from __future__ import annotations

import random

from kvcore.stream import EngineLoad, WorkerStatus
from routing.config import WorkerAddress
from routing.placement.active_load import ActiveLoad
from routing.placement.kv_router import KvRouter
from routing.placement.policies import LeastLoaded
from routing.workers.registry import LoadSource, Worker, WorkerKind, WorkerRegistry


def reading(running: int = 0, queued: int = 0, kv_used: int = 0, prefill: int = 0) -> EngineLoad:
    return EngineLoad(running, queued, kv_used, 4096, prefill)


def figures(load: ActiveLoad, worker: str) -> tuple[int, int, int]:
    got = load.load(worker)
    return got.active_prefill_tokens, got.decode_blocks, got.in_flight


def test_only_the_surplus_over_the_gateways_count_adds_load() -> None:
    """What the gateway sent is counted once; what the engine holds beyond it is added."""
    load = ActiveLoad(block_size=16)
    load.add("r1", "w", [1, 2, 3, 4], prompt_tokens=64)  # 64 prefill tokens, 4 blocks, 1 req
    load.set_engine_load("w", reading(running=1, kv_used=64, prefill=64))  # the same request
    assert figures(load, "w") == (64, 4, 1)
    load.set_engine_load("w", reading(running=3, queued=2, kv_used=64 + 100, prefill=64 + 40))
    assert figures(load, "w") == (104, 4 + 7, 5)  # 100 tokens: 7 blocks, rounded up
    load.finish("r1")  # the gateway's part goes at once; the surplus stays until a reading
    assert figures(load, "w") == (40, 7, 4)
    load.set_engine_load("w", None)
    assert figures(load, "w") == (0, 0, 0)


def test_a_reading_below_the_gateways_count_changes_nothing() -> None:
    """A reading that lags the gateway's dispatches never lowers its live count."""
    load = ActiveLoad(block_size=16)
    load.add("r1", "w", [1, 2], prompt_tokens=32)
    load.set_engine_load("w", reading())
    assert figures(load, "w") == (32, 2, 1)


def test_the_engines_reading_steers_placement() -> None:
    """Two idle workers as the gateway sees them: the one whose engine is busy with others'
    requests loses, under the KV cost and under least-loaded."""
    router = KvRouter(block_size=16, rng=random.Random(0))
    workers = ["a", "b"]
    router.load.set_engine_load("a", reading(running=8, queued=4, kv_used=16 * 200, prefill=900))
    for _ in range(5):
        placement = router.place([11, 12], 32, workers)
        assert placement is not None and placement.worker_id == "b"
        placement = LeastLoaded(router).choose([], 32, workers, ())
        assert placement is not None and placement.worker_id == "b"


def test_registry_hands_readings_on_and_drops_them_with_the_stream() -> None:
    """A status's reading goes to the placement core; a status without one, or the stream
    going down, clears it; the worker says which source its load comes from."""
    heard: list[tuple[str, EngineLoad | None]] = []
    registry = WorkerRegistry(
        on_capacity=lambda w, c: None, on_engine_load=lambda w, r: heard.append((w, r))
    )
    worker = Worker("s0", WorkerAddress.parse("http://127.0.0.1:9"), WorkerKind.SIDECAR)
    registry.add(worker)
    registry.stream_up("s0", "agg")
    registry.reported(WorkerStatus("s0", 1))
    assert heard == [] and worker.load_source is LoadSource.GATEWAY
    busy = reading(running=2)
    registry.reported(WorkerStatus("s0", 2, engine_load=busy))
    assert heard == [("s0", busy)] and worker.load_source is LoadSource.ENGINE
    registry.reported(WorkerStatus("s0", 3))
    assert heard[-1] == ("s0", None) and worker.engine_load is None
    registry.reported(WorkerStatus("s0", 4, engine_load=busy))
    registry.stream_down("s0", "ConnectionError")
    assert heard[-1] == ("s0", None) and worker.load_source is LoadSource.GATEWAY
