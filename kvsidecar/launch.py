"""Starting our processes and knowing when they serve: used by ``kvsidecar up`` and the tests.

Every server of ours (engine, sidecar, gateway) takes ``--ready-file PATH`` and writes one
JSON line per endpoint it serves once it is serving, with the port actually bound (so
``--port 0`` works). ``ManagedProcess`` starts one in its own process group, polls that file
with a deadline (failing early, with the log's tail, if the process dies), and stops it:
SIGTERM, then SIGKILL, then SIGKILL to whatever is left of its group (a child it spawned and
did not reap). ``kvsidecar.local_stack`` starts whole stacks of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

__all__ = ["LaunchError", "ManagedProcess", "Stoppable", "stop_newest_first"]

_POLL_S = 0.02


class LaunchError(RuntimeError):
    """A process exited or stayed silent instead of becoming ready."""


class Stoppable(Protocol):
    def stop(self) -> object: ...


S = TypeVar("S", bound=Stoppable)


def stop_newest_first(procs: list[S], what: str = "processes failed to stop") -> None:
    """Pop and stop every one of ``procs`` (``Stoppable``), newest first; each is stopped
    even when stopping an earlier one failed, the failures raised together afterwards."""
    errors: list[Exception] = []
    while procs:
        try:
            procs.pop().stop()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise ExceptionGroup(what, errors)


@dataclass
class ManagedProcess:
    """One child process with its ready lines and its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    ready_file: Path
    log_path: Path
    ready: list[dict[str, Any]] = field(default_factory=list)
    _log: IO[bytes] | None = None

    @classmethod
    def start(
        cls,
        name: str,
        args: Sequence[str],
        *,
        workdir: Path,
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
        prefix: Sequence[str] = (),
    ) -> ManagedProcess:
        """Run ``python -m <args...> --ready-file <workdir>/<name>.ready``, under ``prefix``
        if given: a tool and its flags that run the interpreter (``valgrind --tool=callgrind``;
        its group still holds the interpreter, so stopping stops both)."""
        workdir.mkdir(parents=True, exist_ok=True)
        ready_file = workdir / f"{name}.ready"
        ready_file.unlink(missing_ok=True)
        log_path = workdir / f"{name}.log"
        log = log_path.open("wb")
        proc = subprocess.Popen(
            [*prefix, python, "-m", *args, "--ready-file", str(ready_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # Ctrl-C in a terminal reaches us, not the children
        )
        return cls(name, proc, ready_file, log_path, _log=log)

    def wait_ready(self, timeout_s: float = 60.0, count: int = 1) -> list[dict[str, Any]]:
        """Block until ``count`` ready lines exist; raise ``LaunchError`` otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            lines = self._ready_lines()
            if len(lines) >= count:
                self.ready = lines
                return lines
            code = self.proc.poll()
            if code is not None:
                self.stop()  # it has exited: this closes its log
                raise LaunchError(
                    f"{self.name} exited with {code} before it was ready:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"{self.name} not ready after {timeout_s:.0f}s:\n{self.log_tail()}"
                )
            time.sleep(_POLL_S)

    @property
    def url(self) -> str:
        return str(self.ready[0]["url"])

    @property
    def pgid(self) -> int:
        """Its process group: its own (``start_new_session``), so its pid."""
        return self.proc.pid

    def group_alive(self) -> bool:
        """Whether any process of its group (it, or one it spawned) still exists."""
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # the group's id taken by someone else's: none of ours
            return False
        return True

    def stop(self, timeout_s: float = 15.0, sig: int = signal.SIGTERM) -> int:
        """Signal the process (SIGTERM by default), wait, SIGKILL if it lingers, then SIGKILL
        what is left of its group; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.group_alive():
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # gone meanwhile
        if self._log is not None:
            self._log.close()
            self._log = None
        return int(self.proc.returncode)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """SIGSTOP its group for the block, SIGCONT on leaving whatever happened: what it
        holds stays held, whatever the machine's speed, while everything else runs on."""
        os.killpg(self.pgid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.killpg(self.pgid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        self.stop(timeout_s=5, sig=signal.SIGKILL)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _ready_lines(self) -> list[dict[str, Any]]:
        try:
            raw = self.ready_file.read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in raw.splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line still being written
        return out
