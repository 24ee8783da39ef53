"""Child processes in tests: reading what they say once ready, and stopping them together.

A ready file or log is read by a check for the waits of ``tests.support.polling``::

    lines = wait_until(lambda: ready_lines(path, proc, count=2), "the engines", 60)
    started = await eventually(lambda: log_event(log, "gateway_started", proc), "the gateway")

Both checks raise ``ProcessExitedError`` (which ends the wait at once) when the process
exited before it was ready.
"""

from __future__ import annotations

import asyncio
import json
import selectors
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, TypeVar

from kvsidecar.launch import Stoppable, stop_newest_first

__all__ = [
    "ProcessExitedError",
    "ProcessGroup",
    "log_event",
    "read_line",
    "ready_lines",
]


class ProcessExitedError(RuntimeError):
    """A process exited before it said it was ready."""


def _check_running(
    proc: subprocess.Popen[Any] | asyncio.subprocess.Process,
    name: str,
    tail: Callable[[], str] | None,
) -> None:
    code = proc.poll() if isinstance(proc, subprocess.Popen) else proc.returncode
    if code is not None:
        detail = f":\n{tail()}" if tail is not None else ""
        raise ProcessExitedError(f"{name} exited with {code} before it was ready{detail}")


def ready_lines(
    path: Path,
    proc: subprocess.Popen[Any] | asyncio.subprocess.Process,
    count: int = 1,
    tail: Callable[[], str] | None = None,
) -> list[str] | None:
    """The non-blank lines of the ready file ``proc`` writes, once it holds ``count``.

    ``None`` until then; ``ProcessExitedError`` (with ``tail()``, if given) once ``proc``
    exited without writing them.
    """
    text = path.read_text() if path.exists() else ""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) >= count:
        return lines
    _check_running(proc, path.name, tail)
    return None


def log_event(
    path: Path, event: str, proc: subprocess.Popen[Any] | asyncio.subprocess.Process
) -> dict[str, Any] | None:
    """The first JSON line of the log ``proc`` writes whose event is ``event``.

    ``None`` until it is there; ``ProcessExitedError`` (with the log) once ``proc`` exited.
    """
    text = path.read_text() if path.exists() else ""
    for line in text.splitlines():
        if f'"{event}"' in line:
            return dict(json.loads(line))
    _check_running(proc, path.name, lambda: text[-2000:])
    return None


def read_line(proc: subprocess.Popen[Any], timeout_s: float = 20.0, prefix: str = "") -> str:
    """The process's next stdout line that starts with ``prefix``, stripped; ``""`` at EOF.

    Lines before it are skipped. ``AssertionError`` when none came within ``timeout_s``.
    For processes that print a line and then wait: a line already buffered behind the one
    read is not seen by the select.
    """
    assert proc.stdout is not None
    end = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            if not sel.select(max(0.0, end - time.monotonic())):
                raise AssertionError(f"no output from pid {proc.pid} within {timeout_s}s")
            raw = proc.stdout.readline()
            line = (raw.decode() if isinstance(raw, bytes) else raw).strip()
            if not raw or line.startswith(prefix):
                return line


P = TypeVar("P", bound=Stoppable)


class ProcessGroup(Generic[P]):
    """The processes a test (or module) started: ``stop()`` ends them all, newest first.

    Each one is stopped even when stopping an earlier one failed; the failures are raised
    together afterwards.
    """

    def __init__(self) -> None:
        self._procs: list[P] = []

    def add(self, proc: P) -> P:
        self._procs.append(proc)
        return proc

    def stop(self) -> None:
        stop_newest_first(self._procs)

    def __enter__(self) -> ProcessGroup[P]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
