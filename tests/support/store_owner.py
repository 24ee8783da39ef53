"""Real block store owners for the storage-hook tests (unit/adapters, engines/adapters): in a
thread of this process, or as ``python -m shm`` in a child process (owner death, restart),
started by ``kvsidecar.local_store`` as the benchmarks start theirs."""

from __future__ import annotations

import asyncio
import threading
import uuid
from pathlib import Path
from types import TracebackType

from kvsidecar.local_store import StoreProcess
from shm import BlockStoreOwner, OwnerConfig

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
    """``python -m shm`` for ``config`` in a child process (``StoreProcess``); ``start()``
    after ``stop()`` brings a successor up on the same owner id and socket."""

    def __init__(self, config: OwnerConfig) -> None:
        self.config = config
        self.store: StoreProcess | None = None

    def start(self) -> OwnerProcess:
        c = self.config
        disk = () if c.disk_dir is None else (
            "--disk-tier-dir", str(c.disk_dir),
            "--disk-tier-capacity-bytes", str(c.disk_capacity_bytes))
        self.store = StoreProcess.start(
            c.socket_path.parent, owner_id=c.owner_id, socket=c.socket_path,
            block_bytes=c.block_bytes, capacity_bytes=c.capacity_bytes,
            args=("--dtype", c.dtype, "--layout", c.layout, *disk))
        return self

    def stop(self) -> None:
        if self.store is not None:
            self.store.stop()
        self.store = None

    def __enter__(self) -> OwnerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
