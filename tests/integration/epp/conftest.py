"""Real processes for the endpoint picker's tests: CPU reference engines, their sidecars and
``python -m routing.epp`` on ephemeral ports, each ready by its ready file."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from kvsidecar.launch import ManagedProcess

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "refengine" / "models" / "tiny"
_EVENTS = json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                      "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"})


@dataclass
class Fleet:
    """Engines with their sidecars, and the picker following them."""

    procs: list[ManagedProcess]
    engines: list[str]  # each engine's ip:port, as Envoy would reach it
    epp_url: str  # the HTTP views
    grpc_target: str

    def stop(self) -> None:
        errors = []
        for proc in reversed(self.procs):
            try:
                proc.stop()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise ExceptionGroup("fleet failed to stop", errors)


def start_epp(procs: list[ManagedProcess], workdir: Path, name: str,
              args: list[str]) -> tuple[str, str]:
    """``python -m routing.epp`` with ``args``, on ephemeral HTTP and gRPC ports."""
    epp = ManagedProcess.start(
        name, ["routing.epp", "--host", "127.0.0.1", "--port", "0", "--grpc-host", "127.0.0.1",
               "--grpc-port", "0", "--health-check-interval-s", "0.5", *args],
        workdir=workdir,
    )
    procs.append(epp)
    ready = epp.wait_ready(60)[0]
    return str(ready["url"]), f"127.0.0.1:{ready['grpc_port']}"


def start_fleet(workdir: Path, replicas: int, epp_args: list[str]) -> Fleet:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    procs: list[ManagedProcess] = []
    try:
        engines, sidecars = [], []
        for i in range(replicas):
            engine = ManagedProcess.start(
                f"engine-{i}", ["refengine", "--compute", "torch", "--port", "0",
                                "--kv-events-config", _EVENTS], workdir=workdir, env=env)
            procs.append(engine)
        for i, engine in enumerate(list(procs)):
            engine_url = engine.wait_ready(120)[0]["url"]
            engines.append(engine_url.removeprefix("http://"))
            sidecar = ManagedProcess.start(
                f"sidecar-{i}", ["sidecar", "--engine-url", engine_url, "--worker-id",
                                 f"w{i}", "--port", "0"], workdir=workdir)
            procs.append(sidecar)
            sidecars.append(sidecar)
        args = list(epp_args)
        for sidecar in sidecars:
            sidecar.wait_ready(60)
            args += ["--sidecar", sidecar.url]
        url, target = start_epp(procs, workdir, "epp", ["--model-path", str(MODEL), *args])
    except BaseException:
        Fleet(procs, [], "", "").stop()
        raise
    return Fleet(procs, engines, url, target)


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
