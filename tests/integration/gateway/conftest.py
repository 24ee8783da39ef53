"""The gateway tests' fleet: fake engines served from threads of this process, and gateways
in front of them, in process too unless a test needs the gateway to be a process (a signal,
its exit code, its log): then ``python -m routing`` through the stack's launcher. Either way
its command line is ``kvsidecar.stack_argv``'s."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import uvloop

from kvsidecar.launch import ManagedProcess, Stoppable, stop_newest_first
from kvsidecar.stack_argv import gateway_argv
from kvsidecar.stack_spec import GatewaySpec
from routing.flags import gateway_config
from routing.serve.gateway import Gateway
from tests.support.fake_openai import FakeEngine
from tests.support.loop_thread import LoopThread

STARTUP_S = 20.0
# The gateway's own defaults, on loopback and any port, no model (bodies forwarded unchanged):
# each test adds its flags after these.
GATEWAY = GatewaySpec(health_check_interval_s=None)


@dataclass
class GatewayProcess:
    """A gateway run as ``python -m routing`` (``ManagedProcess``)."""

    managed: ManagedProcess

    @property
    def port(self) -> int:
        return int(self.managed.ready[0]["port"])

    @property
    def url(self) -> str:
        return self.managed.url

    @property
    def popen(self) -> subprocess.Popen[bytes]:
        return self.managed.proc

    @property
    def log(self) -> Path:
        return self.managed.log_path

    def log_text(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        self.managed.stop(timeout_s=10)


class InProcessGateway:
    """The gateway ``python -m routing`` would run, on a uvloop in a thread of this process;
    stopped as on SIGTERM (``Gateway.stop`` with its drain timeout)."""

    def __init__(self, argv: list[str]) -> None:
        self._cfg = gateway_config(argv)
        self._thread = LoopThread("gateway", uvloop.new_event_loop).start()
        self._gateway: Gateway | None = None
        try:
            self.port = self._thread.run(self._start(), STARTUP_S)
        except BaseException:
            self.stop()
            raise

    async def _start(self) -> int:
        self._gateway = Gateway(self._cfg)
        return await self._gateway.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._gateway is not None:
            gateway, self._gateway = self._gateway, None
            drain = self._cfg.drain_timeout_s
            self._thread.run(gateway.stop(drain), drain + STARTUP_S)
        self._thread.close()


class Spawner:
    """Starts engines and gateways for one test (or module) and stops them all afterwards,
    newest first."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.running: list[Stoppable] = []

    def engine(self, model: str = "fake-model") -> FakeEngine:
        engine = FakeEngine(model)
        self.running.append(engine)  # stopped even when it failed to start
        return engine.start()

    def gateway(self, workers: list[FakeEngine | str], *flags: str,
                process: bool = False) -> InProcessGateway | GatewayProcess:
        """A gateway in front of ``workers`` with ``flags``, serving; ``process``: run as
        ``python -m routing``."""
        urls = [w if isinstance(w, str) else w.url for w in workers]
        argv = gateway_argv(replace(GATEWAY, args=flags), None, [],
                            more=[f for url in urls for f in ("--worker", url)])
        if not process:
            gateway = InProcessGateway(argv)
            self.running.append(gateway)
            return gateway
        managed = ManagedProcess.start(f"gateway-{len(self.running)}", ["routing", *argv],
                                       workdir=self.tmp)
        self.running.append(managed)
        managed.wait_ready(STARTUP_S)
        self.running[-1] = proc = GatewayProcess(managed)
        return proc

    def stop_all(self) -> None:
        stop_newest_first(self.running)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawner]:
    """Per-test engines and gateways, stopped at teardown."""
    spawner = Spawner(tmp_path)
    yield spawner
    spawner.stop_all()


@pytest.fixture(scope="module")
def module_spawn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spawner]:
    """Engines and gateways shared by a module's tests."""
    spawner = Spawner(tmp_path_factory.mktemp("gateway"))
    yield spawner
    spawner.stop_all()
