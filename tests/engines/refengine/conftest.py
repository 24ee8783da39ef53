"""Start real ``python -m refengine`` processes on ephemeral ports and talk plain HTTP to them."""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.polling import wait_http_ok, wait_until
from tests.support.processes import ProcessExitedError, ProcessGroup

ROOT = Path(__file__).resolve().parents[3]
EVENTS_CONFIG = json.dumps(
    {
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "topic": "kv-events",
    }
)


@dataclass
class EngineProcess:
    proc: subprocess.Popen[str]
    ready: list[dict[str, Any]]
    log: Path
    pump: threading.Thread | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return str(self.ready[0]["url"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.pump is not None:
            self.pump.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def http(method: str, url: str, body: Any = None, timeout: float = 60) -> tuple[int, Any]:
    """One request; returns (status, parsed JSON or text)."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode()


def sse(url: str, body: Any, timeout: float = 60) -> list[Any]:
    """POST and collect the ``data:`` payloads of an SSE stream (``[DONE]`` kept as a string)."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    out: list[Any] = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def start_engine(
    tmp_path: Path, *args: str, replicas: int = 1, deadline_s: float = 90
) -> EngineProcess:
    """Launch the engine, read its ready line(s) from stdout, and wait for /health."""
    log = tmp_path / f"engine-{time.monotonic_ns()}.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "refengine", "--port", "0", "--torch-threads", "1", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    engine = EngineProcess(proc, [], log, thread)

    def all_ready() -> bool:
        """Take a ready line the pump queued (waiting up to 0.5 s); all of them yet?"""
        if proc.poll() is not None:
            raise ProcessExitedError(f"engine exited with {proc.returncode}: {log.read_text()}")
        with contextlib.suppress(queue.Empty):
            engine.ready.append(json.loads(lines.get(timeout=0.5)))
        return len(engine.ready) >= replicas

    end = time.monotonic() + deadline_s
    try:
        wait_until(all_ready, "the engine's ready lines", deadline_s, interval_s=0)
        for ready in engine.ready:
            wait_http_ok(ready["url"] + "/health", "the engine to be healthy",
                         max(0.0, end - time.monotonic()))
    except BaseException:
        engine.stop()
        raise
    return engine


class Harness:
    """The helpers tests use, handed out as a fixture (test modules here are not a package)."""

    EVENTS_CONFIG = EVENTS_CONFIG
    ROOT = ROOT
    http = staticmethod(http)
    sse = staticmethod(sse)

    def __init__(self, tmp_path: Path, started: ProcessGroup[EngineProcess]) -> None:
        self.tmp_path = tmp_path
        self.started = started

    def start(self, *args: str, replicas: int = 1) -> EngineProcess:
        return self.started.add(start_engine(self.tmp_path, *args, replicas=replicas))


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    """HTTP helpers plus an engine launcher that stops what it started."""
    with ProcessGroup[EngineProcess]() as started:
        yield Harness(tmp_path, started)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """One torch engine with KV events on, shared by a module's tests."""
    tmp = tmp_path_factory.mktemp("engine")
    proc = start_engine(tmp, "--kv-events-config", EVENTS_CONFIG, "--max-total-tokens", "4096")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def small_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """A torch engine with KV events and a 20-page pool, so eviction happens."""
    proc = start_engine(
        tmp_path_factory.mktemp("ev"),
        "--kv-events-config",
        EVENTS_CONFIG,
        "--max-total-tokens",
        "320",
    )
    yield proc
    proc.stop()
