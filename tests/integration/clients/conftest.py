"""A real stack for the official SDKs: a simulated reference engine, its sidecar, and two
gateways in front of it (through the sidecar, and straight to the engine as a plain worker),
started once for the directory; ``Stack.gateway`` starts more gateways on the same workers."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvsidecar.launch import ManagedProcess
from tests.support.polling import wait_until

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "refengine" / "models" / "tiny"
MODEL_NAME = "tiny"
EVENTS = json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                     "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"})


def routable_workers(url: str) -> int:
    """How many of the gateway's workers are routable now."""
    with urllib.request.urlopen(f"{url}/v1/workers", timeout=5) as resp:
        workers = json.loads(resp.read())["workers"]
    return sum(bool(w["routable"]) for w in workers)


@dataclass
class Stack:
    tmp: Path
    engine: ManagedProcess
    sidecar: ManagedProcess
    procs: list[ManagedProcess] = field(default_factory=list)

    @property
    def engine_url(self) -> str:
        return self.engine.url

    def gateway(self, name: str, *flags: str, wait_routable: bool = True) -> ManagedProcess:
        """A gateway serving the tiny model with ``flags`` (its workers among them),
        stopped with the stack; with ``wait_routable``, once a worker is routable."""
        gateway = ManagedProcess.start(
            name, ["routing", "--port", "0", "--host", "127.0.0.1", "--model-path", str(MODEL),
                   "--health-check-interval-s", "0.2", *flags],
            workdir=self.tmp)
        self.procs.append(gateway)
        gateway.wait_ready(60)
        if wait_routable:
            wait_until(lambda: routable_workers(gateway.url) >= 1,
                       f"a routable worker behind {name}", 60, 0.05)
        return gateway

    def stop(self) -> None:
        for proc in reversed([self.engine, self.sidecar, *self.procs]):
            proc.stop()


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One simulated engine and its sidecar, shared by the client suites."""
    tmp = tmp_path_factory.mktemp("clients")
    engine = ManagedProcess.start(
        "engine", ["refengine", "--compute", "sim", "--replicas", "1", "--port", "0",
                   "--kv-events-config", EVENTS], workdir=tmp)
    try:
        engine.wait_ready(60)
        sidecar = ManagedProcess.start(
            "sidecar", ["sidecar", "--engine-url", engine.url, "--worker-id", "replica-0",
                        "--port", "0"], workdir=tmp)
    except BaseException:
        engine.stop()
        raise
    s = Stack(tmp, engine, sidecar)
    try:
        sidecar.wait_ready(60)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="package")
def gateway_url(stack: Stack) -> str:
    """A KV-aware gateway whose worker is the sidecar."""
    return stack.gateway("gateway", "--sidecar", stack.sidecar.url, "--router-mode", "kv").url


@pytest.fixture(scope="package")
def plain_gateway_url(stack: Stack) -> str:
    """A gateway whose worker is the engine itself (a plain OpenAI worker)."""
    return stack.gateway("gateway-plain", "--worker", stack.engine_url).url
