"""Real processes for the endpoint picker's tests: simulated reference engines and their
sidecars (a ``LocalStack``) and ``python -m routing.epp`` on ephemeral ports (its command line
from ``kvsidecar.stack_argv``), each ready by its ready file."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from kvsidecar.launch import ManagedProcess, Stoppable, stop_newest_first
from kvsidecar.local_stack import EngineSpec, LocalStack, StackSpec
from kvsidecar.stack_argv import epp_argv

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "refengine" / "models" / "tiny"


@dataclass
class Fleet:
    """Engines with their sidecars, and the picker following them."""

    procs: list[ManagedProcess]  # the pickers, stopped before the stack
    engines: list[str]  # each engine's ip:port, as Envoy would reach it
    epp_url: str  # the HTTP views
    grpc_target: str
    stack: LocalStack | None = None

    def stop(self) -> None:
        servers: list[Stoppable] = [*([self.stack] if self.stack else []), *self.procs]
        stop_newest_first(servers, "fleet failed to stop")


def start_epp(procs: list[ManagedProcess], workdir: Path, name: str,
              args: list[str]) -> tuple[str, str]:
    """``python -m routing.epp`` with ``args``, on ephemeral HTTP and gRPC ports."""
    epp = ManagedProcess.start(name, epp_argv("--health-check-interval-s", "0.5", *args),
                               workdir=workdir)
    procs.append(epp)
    ready = epp.wait_ready(60)[0]
    return str(ready["url"]), f"127.0.0.1:{ready['grpc_port']}"


def start_fleet(workdir: Path, replicas: int, epp_args: list[str]) -> Fleet:
    """``replicas`` simulated reference engines (what the picker is tested on is its picks
    and their load, not the engines' compute), a sidecar each (workers ``w<i>``), and a
    picker following them."""
    spec = StackSpec(engines=(EngineSpec(replicas=replicas,
                                         worker_ids=tuple(f"w{i}" for i in range(replicas))),),
                     gateways=(), model_path=str(MODEL))
    fleet = Fleet([], [], "", "", LocalStack(spec, workdir))
    try:
        assert fleet.stack is not None
        fleet.stack.start()
        fleet.engines = [p.url.removeprefix("http://") for p in fleet.stack.engines]
        sidecars = [f for p in fleet.stack.sidecars for f in ("--sidecar", p.url)]
        fleet.epp_url, fleet.grpc_target = start_epp(
            fleet.procs, workdir, "epp", ["--model-path", str(MODEL), *epp_args, *sidecars])
    except BaseException:
        fleet.stop()
        raise
    return fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two reference engines, their sidecars and a picker following both."""
    running = start_fleet(tmp_path_factory.mktemp("epp"), 2, ["--overlap-weight", "1"])
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
async def channel(fleet: Fleet) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(fleet.grpc_target) as ch:
        yield ch


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def workers(session: aiohttp.ClientSession, url: str) -> dict[str, dict[str, Any]]:
    """The picker's ``/v1/workers``, by worker id."""
    async with session.get(f"{url}/v1/workers") as resp:
        assert resp.status == 200
        return {w["worker_id"]: w for w in (await resp.json())["workers"]}
