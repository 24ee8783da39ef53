"""Real block store owners for the storage-hook tests (unit/adapters, engines/adapters): in a
thread of this process, or as ``python -m shm`` in a child process (owner death, restart)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from types import TracebackType

from shm import BlockStoreOwner, OwnerConfig
from tests.support.polling import wait_until
from tests.support.processes import ready_lines

_READY_TIMEOUT_S = 30.0


def owner_config(sock_dir: Path, block_bytes: int, *, dtype: str = "uint8",
                 layout: str = "raw", num_slots: int = 64) -> OwnerConfig:
    """A fresh owner id and socket under ``sock_dir`` for a store of ``num_slots`` blocks."""
    owner_id = f"t{uuid.uuid4().hex[:10]}"
    return OwnerConfig(owner_id=owner_id, socket_path=sock_dir / f"{owner_id}.sock",
                       capacity_bytes=block_bytes * num_slots, block_bytes=block_bytes,
                       dtype=dtype, layout=layout)


class OwnerThread:
    """A ``BlockStoreOwner`` serving on its own event loop in a background thread."""

    def __init__(self, config: OwnerConfig) -> None:
        self.config = config
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="store-owner", daemon=True)

    def _run(self) -> None:
        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            async with BlockStoreOwner(self.config):
                self._ready.set()
                await self._stop.wait()

        try:
            asyncio.run(serve())
        except BaseException as exc:  # reported to the test thread by __enter__/stop
            self._error = exc
            self._ready.set()

    def __enter__(self) -> OwnerThread:
        self._thread.start()
        if not self._ready.wait(_READY_TIMEOUT_S):
            raise TimeoutError("the block store owner did not start")
        if self._error is not None:
            raise RuntimeError("the block store owner failed to start") from self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(_READY_TIMEOUT_S)
        if self._thread.is_alive():
            raise TimeoutError("the block store owner did not stop")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class OwnerProcess:
    """``python -m shm`` in a child process; ready once it writes its ready file."""

    def __init__(self, config: OwnerConfig) -> None:
        self.config = config
        self.ready_file = config.socket_path.with_suffix(".ready")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OwnerProcess:
        self.ready_file.unlink(missing_ok=True)
        c = self.config
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shm", "--owner-id", c.owner_id, "--socket",
             str(c.socket_path), "--capacity-bytes", str(c.capacity_bytes), "--block-bytes",
             str(c.block_bytes), "--dtype", c.dtype, "--layout", c.layout,
             "--ready-file", str(self.ready_file), "--log-level", "warning",
             *(() if c.disk_dir is None else ("--disk-tier-dir", str(c.disk_dir),
                                              "--disk-tier-capacity-bytes",
                                              str(c.disk_capacity_bytes)))],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=os.getcwd())
        proc = self.proc
        try:
            wait_until(lambda: ready_lines(self.ready_file, proc, tail=self._stderr),
                       "python -m shm to become ready", _READY_TIMEOUT_S, interval_s=0.01)
        except AssertionError:
            self.stop()
            raise
        return self

    def _stderr(self) -> str:
        return self.proc.stderr.read().decode() if self.proc and self.proc.stderr else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(_READY_TIMEOUT_S)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None

    def __enter__(self) -> OwnerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
