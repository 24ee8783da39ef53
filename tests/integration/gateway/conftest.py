"""Real processes for gateway tests: fake engines and ``python -m routing`` on port 0."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

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
        deadline = time.monotonic() + STARTUP_S
        assert popen.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([popen.stdout], [], [], deadline - time.monotonic())
            if ready:
                line = popen.stdout.readline().decode()
                if line.startswith("FAKE_ENGINE_PORT="):
                    proc = Proc(popen, int(line.split("=", 1)[1]))
                    self.procs.append(proc)
                    return proc
                if not line:
                    break
        popen.kill()
        raise RuntimeError("fake engine did not start")

    def gateway(self, workers: list[Proc | str], *flags: str) -> Proc:
        log = self.tmp / f"gateway-{len(self.procs)}.log"
        args = [sys.executable, "-m", "routing", "--port", "0", "--host", "127.0.0.1"]
        for w in workers:
            args += ["--worker", w if isinstance(w, str) else w.url]
        with log.open("wb") as out:
            popen = subprocess.Popen([*args, *flags], cwd=ROOT, stdout=out, stderr=out)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            for line in log.read_text().splitlines():
                if '"gateway_started"' in line:
                    proc = Proc(popen, json.loads(line)["port"], log)
                    self.procs.append(proc)
                    return proc
            if popen.poll() is not None:
                raise RuntimeError(f"gateway exited: {log.read_text()}")
            time.sleep(0.02)  # polling the log file for the ready line, with a deadline
        popen.kill()
        raise RuntimeError(f"gateway did not start: {log.read_text()}")

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
