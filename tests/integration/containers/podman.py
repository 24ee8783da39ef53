"""Containers in tests: building our images with podman and running compose stacks on it.

Stacks run with Debian's docker-compose (v1) talking to podman's Docker-compatible API
(``podman system service`` on a socket of the test's own), which is what podman's compose
provider does. podman-compose (Debian's 1.0.3, and PyPI's up to 1.6) ignores ``ipc:``, so a
sidecar would not share its engine's shared memory and the stack would not be the one users
run with docker compose.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.polling import wait_until

ROOT = Path(__file__).resolve().parents[3]
BUILD = ROOT / "scripts" / "build_images.py"

__all__ = ["Compose", "build_images", "podman", "podman_service", "require"]


def require(tool: str) -> str:
    path = shutil.which(tool)
    assert path, f"{tool} is not installed (scripts/test installs it from Debian)"
    return path


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=300)
    if check:
        assert out.returncode == 0, f"podman {' '.join(args)}: {out.stderr.strip()}"
    return out


def build_images(*args: str) -> float:
    """Run scripts/build_images.py --host-pip ARGS; the seconds it took."""
    require("podman")
    started = time.monotonic()
    out = subprocess.run([sys.executable, str(BUILD), "--host-pip", *args],
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, f"build_images.py {' '.join(args)} failed:\n{out.stderr[-4000:]}"
    took = time.monotonic() - started
    print(f"build_images.py {' '.join(args)}: {took:.0f}s\n{out.stderr}")
    return took


def _ping(sock: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(str(sock))
            s.sendall(b"GET /_ping HTTP/1.0\r\nHost: podman\r\n\r\n")
            return b"OK" in s.recv(4096)
    except OSError:
        return False


@contextmanager
def podman_service() -> Iterator[str]:
    """podman's Docker API on a fresh socket for the duration; yields its DOCKER_HOST."""
    require("podman")
    workdir = Path(tempfile.mkdtemp(prefix="kvs-podman-"))
    sock = workdir / "podman.sock"
    log = (workdir / "service.log").open("wb")
    proc = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{sock}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            assert proc.poll() is None, (workdir / "service.log").read_text()
            return _ping(sock)

        wait_until(up, "podman's API socket", timeout_s=30, interval_s=0.1)
        yield f"unix://{sock}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)


@dataclass
class Compose:
    """docker-compose on podman's API, for one project (its containers carry its label)."""

    docker_host: str
    project: str
    files: Sequence[Path]
    env: dict[str, str]

    def run(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        cmd = [require("docker-compose"), "-p", self.project]
        for f in self.files:
            cmd += ["-f", str(f)]
        env = {**os.environ, **self.env, "DOCKER_HOST": self.docker_host}
        return subprocess.run([*cmd, *args], capture_output=True, text=True, env=env,
                              timeout=timeout_s)

    def containers(self) -> dict[str, tuple[str, int]]:
        """name → (state, exit code) of every container of the project, running or not."""
        out = podman("ps", "-a", "--filter", f"label=com.docker.compose.project={self.project}",
                     "--format", "json").stdout
        rows = json.loads(out or "[]")
        return {r["Names"][0]: (str(r["State"]), int(r["ExitCode"])) for r in rows}

    def logs(self) -> str:
        return self.run("logs", "--no-color", "--tail", "30").stdout[-6000:]

    def down(self) -> None:
        """Remove the project's containers and network.

        docker-compose removes containers in parallel, and podman refuses to remove an engine
        while the sidecar sharing its IPC namespace still exists: a second pass removes what
        the first could not.
        """
        first = self.run("down", "--remove-orphans", "--timeout", "30")
        if self.containers() or first.returncode != 0:
            second = self.run("down", "--remove-orphans", "--timeout", "30")
            assert second.returncode == 0, second.stderr
