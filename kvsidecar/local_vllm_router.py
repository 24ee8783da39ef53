"""vllm-router (``pip install vllm-router``, the ``peers`` extra) run locally as a subprocess:
the consumer our republished vLLM-format events are proved against (its tests, and
``scripts/bench_vllm_router.py``), as ``local_vllm``, ``local_redis`` and ``local_nats`` run
the other programs of someone else's that tests and benchmarks need.

It cannot bind port 0 and report it, so it gets a port found free just before (the one case
where a test picks a port). Ready once ``GET /health`` answers 200. With ``debug`` its log
says how far it read each event source (``kv_index live sequence advanced``), which
``applied_seq`` reads: a test waits on that instead of hoping the router has read an event.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvsidecar.launch import ManagedProcess

__all__ = ["VllmRouter", "vllm_router_binary"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ADVANCED = re.compile(
    r"kv_index (?:live|replay) sequence advanced source=(\S+) rank=\d+ seq=(\d+)"
)


def vllm_router_binary() -> str | None:
    """The ``vllm-router`` beside this Python, else on PATH (None: not installed)."""
    here = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    return here or shutil.which("vllm-router")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class VllmRouter:
    """One vllm-router process over ``workers`` (engine URL → (event, replay) endpoints)."""

    process: ManagedProcess  # (no ready file: ``wait_ready`` polls its /health)
    url: str

    @classmethod
    def start(
        cls,
        workdir: Path,
        name: str,
        workers: Mapping[str, tuple[str, str | None]],
        *,
        policy: str,
        model: str = "tiny",
        block_size: int = 16,
        debug: bool = False,
        extra: Sequence[str] = (),
    ) -> VllmRouter:
        binary = vllm_router_binary()
        if binary is None:
            raise RuntimeError("vllm-router is not installed (pip install -e '.[peers]')")
        port = _free_port()
        args = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                "--worker-urls", *workers, "--log-level", "debug" if debug else "warning",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]
        if policy == "kv_aware":
            args += ["--kv-event-model", model, "--kv-event-block-size", str(block_size)]
            for url, (events, replay) in workers.items():
                args += ["--kv-event-source", f"{url}={events}"]
                if replay is not None:
                    args += ["--kv-event-replay-source", f"{url}={replay}"]
        log_path = workdir / f"{name}.log"
        log = log_path.open("wb")
        proc = subprocess.Popen(
            [*args, *extra], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "NO_COLOR": "1"}, start_new_session=True,
        )
        managed = ManagedProcess(name, proc, workdir / f"{name}.ready", log_path, _log=log)
        return cls(managed, f"http://127.0.0.1:{port}")

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if self.process.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router did not start:\n{self.log_tail()}")
            time.sleep(0.1)

    def applied_seq(self, source: str) -> int | None:
        """The last seq the router read from ``source``'s event stream (needs ``debug``)."""
        last = None
        for match in _ADVANCED.finditer(self.log_text()):
            if match.group(1) == source:
                last = int(match.group(2))
        return last

    def log_text(self) -> str:
        return _ANSI.sub("", self.process.log_path.read_text(errors="replace"))

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self) -> None:
        self.process.stop()
