"""Real processes for gateway tests: fake engines and ``python -m routing`` on port 0."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.polling import wait_until
from tests.support.processes import log_event, read_line

ROOT = Path(__file__).resolve().parents[3]
FAKE = Path(__file__).with_name("fake_openai.py")
STARTUP_S = 20.0


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    port: int
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text() if self.log else ""

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        if self.popen.stdout is not None:
            self.popen.stdout.close()


class Spawner:
    """Starts processes for one test (or module) and stops them all afterwards."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []

    def engine(self, model: str = "fake-model") -> Proc:
        popen = subprocess.Popen(
            [sys.executable, str(FAKE), "--port", "0", "--model", model],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        try:
            line = read_line(popen, STARTUP_S, prefix="FAKE_ENGINE_PORT=")
            assert line, "the fake engine exited before it listened"
        except AssertionError:
            popen.kill()
            raise
        proc = Proc(popen, int(line.split("=", 1)[1]))
        self.procs.append(proc)
        return proc

    def gateway(self, workers: list[Proc | str], *flags: str) -> Proc:
        log = self.tmp / f"gateway-{len(self.procs)}.log"
        args = [sys.executable, "-m", "routing", "--port", "0", "--host", "127.0.0.1"]
        for w in workers:
            args += ["--worker", w if isinstance(w, str) else w.url]
        with log.open("wb") as out:
            popen = subprocess.Popen([*args, *flags], cwd=ROOT, stdout=out, stderr=out)
        try:
            started = wait_until(lambda: log_event(log, "gateway_started", popen),
                                 f"the gateway to start (log: {log})", STARTUP_S)
        except AssertionError:
            popen.kill()
            raise
        proc = Proc(popen, started["port"], log)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawner]:
    """Per-test processes, stopped at teardown."""
    spawner = Spawner(tmp_path)
    yield spawner
    spawner.stop_all()


@pytest.fixture(scope="module")
def module_spawn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spawner]:
    """Processes shared by a module's tests."""
    spawner = Spawner(tmp_path_factory.mktemp("gateway"))
    yield spawner
    spawner.stop_all()
