"""Start real ``python -m refengine`` processes on ephemeral ports (``ManagedProcess``, the
engine's command line from ``kvsidecar.stack_argv``) and talk plain HTTP to them."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.launch import ManagedProcess
from kvsidecar.stack_argv import lone_refengine_argv
from kvsidecar.stack_spec import EVENTS_CONFIG
from tests.support.polling import wait_http_ok
from tests.support.processes import ProcessGroup

ROOT = Path(__file__).resolve().parents[3]


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


def start_engine(workdir: Path, name: str, *args: str, replicas: int = 1,
                 deadline_s: float = 90) -> ManagedProcess:
    """``python -m refengine`` alone on any port with one torch thread, then ``args``: its
    ``replicas`` ready lines, then each replica's /health answering 200."""
    proc = ManagedProcess.start(name, lone_refengine_argv("--torch-threads", "1", *args),
                                workdir=workdir)
    try:
        proc.wait_ready(deadline_s, count=replicas)
        for ready in proc.ready:
            wait_http_ok(ready["url"] + "/health", "the engine to be healthy", deadline_s)
    except BaseException:
        proc.stop()
        raise
    return proc


class Harness:
    """The helpers tests use, handed out as a fixture (test modules here are not a package)."""

    EVENTS_CONFIG = EVENTS_CONFIG
    ROOT = ROOT
    http = staticmethod(http)
    sse = staticmethod(sse)

    def __init__(self, tmp_path: Path, started: ProcessGroup[ManagedProcess]) -> None:
        self.tmp_path = tmp_path
        self.started = started
        self.count = 0

    def start(self, *args: str, replicas: int = 1) -> ManagedProcess:
        self.count += 1
        engine = start_engine(self.tmp_path, f"engine-{self.count}", *args, replicas=replicas)
        return self.started.add(engine)


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    """HTTP helpers plus an engine launcher that stops what it started."""
    with ProcessGroup[ManagedProcess]() as started:
        yield Harness(tmp_path, started)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    """One torch engine with KV events on, shared by a module's tests."""
    tmp = tmp_path_factory.mktemp("engine")
    proc = start_engine(tmp, "engine", "--kv-events-config", EVENTS_CONFIG,
                        "--max-total-tokens", "4096")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def small_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    """A torch engine with KV events and a 20-page pool, so eviction happens."""
    proc = start_engine(
        tmp_path_factory.mktemp("ev"),
        "engine",
        "--kv-events-config",
        EVENTS_CONFIG,
        "--max-total-tokens",
        "320",
    )
    yield proc
    proc.stop()
