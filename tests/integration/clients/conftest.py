"""A real stack for the official SDKs: a simulated reference engine, its sidecar, and two
gateways in front of it (through the sidecar, and straight to the engine as a plain worker),
started once for the directory; ``Stack.gateway`` starts more gateways on the same workers."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvsidecar.launch import ManagedProcess
from kvsidecar.local_stack import GatewaySpec, LocalStack, StackSpec
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
    local: LocalStack

    @property
    def engine(self) -> ManagedProcess:
        return self.local.engines[0].proc

    @property
    def sidecar(self) -> ManagedProcess:
        return self.local.sidecars[0].proc

    @property
    def engine_url(self) -> str:
        return self.engine.url

    def gateway(self, name: str, *flags: str, wait_routable: bool = True) -> ManagedProcess:
        """A gateway serving the tiny model with ``flags`` (its workers among them),
        stopped with the stack; with ``wait_routable``, once a worker is routable."""
        gateway = self.local.add_gateway(GatewaySpec(
            name=name, workers="none", health_check_interval_s=0.2, wait_routable=False,
            args=flags))[0].proc
        if wait_routable:
            wait_until(lambda: routable_workers(gateway.url) >= 1,
                       f"a routable worker behind {name}", 60, 0.05)
        return gateway

    def stop(self) -> None:
        self.local.stop()


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One simulated engine and its sidecar, shared by the client suites."""
    tmp = tmp_path_factory.mktemp("clients")
    spec = StackSpec(gateways=(), model_path=str(MODEL), events_config=EVENTS)
    s = Stack(tmp, LocalStack(spec, tmp).start())
    try:
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
