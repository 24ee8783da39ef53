"""A server of someone else's (``redis-server``, ``nats-server``) run locally on an ephemeral
port, for tests and benchmarks: ``kvsidecar.local_redis``, ``kvsidecar.local_nats``.

The port is picked free, then bound by the server: if another process took it meanwhile, the
server fails to start and another port is tried. Ready once it answers on its port (each
kind says how); ``kill()`` drops it at once, ``start()`` again brings it back on its port.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Self

__all__ = ["LocalServer"]

_START_TRIES = 5
_READY_S = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalServer:
    """One server process; ``with Kind(workdir) as server:`` ... ``server.url``."""

    binary_name = ""  # the executable, found on PATH
    package = ""  # the Debian package that has it

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which(self.binary_name)
        if binary is None:
            raise RuntimeError(f"{self.binary_name} is not installed (Debian: apt-get install "
                               f"{self.package}; scripts/test installs it)")
        self.binary = binary
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        raise NotImplementedError

    def argv(self, port: int) -> list[str]:
        """The command line serving on ``port``."""
        raise NotImplementedError

    def answers(self, port: int) -> bool:
        """Whether the server on ``port`` serves yet."""
        raise NotImplementedError

    def start(self) -> Self:
        """Start (again, on the same port once it had one)."""
        for _ in range(_START_TRIES):
            port = self.port or _free_port()
            log = open(self.workdir / f"{self.binary_name}-{port}.log", "ab")  # noqa: SIM115
            self.proc = subprocess.Popen(self.argv(port), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
            log.close()
            if self._wait_ready(port):
                self.port = port
                return self
            self.proc.wait()
            if self.port:
                break  # its own port must be taken: a second try would not help
        raise RuntimeError(f"{self.binary_name} did not start; see "
                           f"{self.workdir}/{self.binary_name}-*.log")

    def _wait_ready(self, port: int) -> bool:
        """Poll until the server answers (True) or exits or 20 s pass (False)."""
        assert self.proc is not None
        deadline = time.monotonic() + _READY_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.answers(port):
                return True
            time.sleep(0.02)  # between polls
        if self.proc.poll() is None:
            self.proc.kill()
        return False

    def kill(self) -> None:
        """SIGKILL: the server vanishes with its connections and what it held in memory."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
