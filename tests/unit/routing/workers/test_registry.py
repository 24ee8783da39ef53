"""The worker registry: routable only when probe and stream both say so, pools per role."""

from __future__ import annotations

import pytest

from kvcore.stream import WorkerStatus
from routing.config import WorkerAddress
from routing.workers.registry import Health, Role, Worker, WorkerKind, WorkerRegistry

ADDRESS = WorkerAddress.parse("http://127.0.0.1:9000")


class Heard:
    """What the registry told the placement core and the prober."""

    def __init__(self) -> None:
        self.capacity: list[tuple[str, int | None]] = []
        self.probes: list[str] = []

    def registry(self) -> WorkerRegistry:
        registry = WorkerRegistry(on_capacity=lambda w, c: self.capacity.append((w, c)))
        registry.probe_soon = lambda worker: self.probes.append(worker.worker_id)
        return registry


def sidecar_worker(worker_id: str = "s0") -> Worker:
    return Worker(worker_id, ADDRESS, WorkerKind.SIDECAR, dp_rank=0)


def test_plain_worker_is_routable_on_its_probe_alone() -> None:
    """A plain engine has no stream: its probe decides."""
    registry = Heard().registry()
    worker = Worker("p0", ADDRESS)
    registry.add(worker)
    assert registry.routable() == [worker]
    registry.probed(worker, False, "OSError: refused")
    assert worker.health is Health.PROBE_FAILED and worker.reason == "OSError: refused"
    assert registry.routable() == []
    registry.probed(worker, True)
    assert registry.routable() == [worker]


def test_sidecar_worker_needs_its_stream_and_its_status() -> None:
    """A sidecar worker waits for its stream and the stream's first status (its sidecar may
    stand beside an engine that is down); a status saying unroutable takes it out."""
    registry = Heard().registry()
    worker = sidecar_worker()
    registry.add(worker)
    assert worker.health is Health.STREAM_DOWN and registry.routable() == []
    registry.stream_up("s0", "agg")
    assert worker.health is Health.UNROUTABLE and registry.routable() == []
    assert worker.reason == "its sidecar has sent no status yet"
    registry.reported(WorkerStatus("s0", 0, True))
    assert registry.routable() == [worker]
    registry.reported(WorkerStatus("s0", 1, False, "draining"))
    assert worker.health is Health.UNROUTABLE and worker.reason == "draining"
    assert registry.routable() == []
    registry.reported(WorkerStatus("s0", 2, True))
    assert registry.routable() == [worker]
    registry.stream_down("s0", "ConnectionError: stream ended")
    assert worker.health is Health.STREAM_DOWN and worker.reason == "ConnectionError: stream ended"
    assert registry.routable() == []


def test_a_routable_status_asks_for_a_probe_of_a_failed_worker() -> None:
    """Probe failed but the stream says routable: the prober is asked at once, and the
    worker stays out until that probe answers."""
    heard = Heard()
    registry = heard.registry()
    worker = sidecar_worker()
    registry.add(worker)
    registry.stream_up("s0", "agg")
    registry.probed(worker, False, "connect: refused")
    registry.reported(WorkerStatus("s0", 1, True))
    assert heard.probes == ["s0"] and registry.routable() == []
    registry.probed(worker, True)
    assert registry.routable() == [worker]


def test_roles_make_pools_and_capacity_reaches_the_placement_core() -> None:
    """Each role is its own pool; a reported KV capacity is passed on when it changes."""
    heard = Heard()
    registry = heard.registry()
    prefill, decode = sidecar_worker("p"), sidecar_worker("d")
    registry.add(prefill)
    registry.add(decode)
    registry.stream_up("p", "prefill")
    registry.stream_up("d", "decode")
    registry.reported(WorkerStatus("p", 1, True, "", "prefill"))
    registry.reported(WorkerStatus("d", 1, True, "", "decode", 4096))
    registry.reported(WorkerStatus("d", 2, True, "", "decode", 4096))
    assert registry.routable(Role.PREFILL) == [prefill]
    assert registry.routable(Role.DECODE) == [decode]
    assert registry.routable(Role.AGG) == [] and registry.has_roles()
    assert heard.capacity == [("p", None), ("d", 4096)] and decode.capacity_blocks == 4096


def test_membership() -> None:
    """Workers join once; a removed one leaves every pool; reports for strangers are ignored."""
    registry = Heard().registry()
    worker = Worker("p0", ADDRESS, models=("m",))
    registry.add(worker)
    with pytest.raises(ValueError, match="already registered"):
        registry.add(Worker("p0", ADDRESS))
    registry.reported(WorkerStatus("nobody", 1, False))
    registry.stream_up("nobody", "agg")
    assert registry.models() == ["m"] and len(registry) == 1
    registry.remove("p0")
    assert registry.routable() == [] and registry.get("p0") is None
