"""A block store owner of ours run alone as a process, for tests and benchmarks:
``python -m shm`` (the store; ``kvsidecar shm``) or, with ``peer=True``,
``python -m sidecar.transfer`` (the store with its transfer service, a block peer;
``kvsidecar blocks``).

It is not a ``LocalStack`` part: a stack's sidecars own their stores themselves, while this
starts a store with no engine, sidecar or gateway around it, for what measures or tests the
store (or the transfer between two) on its own. It runs through ``ManagedProcess`` all the
same: its own process group, its ready file polled against a deadline (the log's tail when
it exits first), SIGTERM then SIGKILL to stop it, its command line from
``kvsidecar.stack_argv``::

    with StoreProcess.start(tmp, block_bytes=4096, capacity_bytes=1 << 20) as store:
        BlockStoreClient(store.socket)  # ... and store.segment, store.url (a peer's)
"""

from __future__ import annotations

import signal
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from kvsidecar.launch import ManagedProcess
from kvsidecar.stack_argv import store_owner_argv
from shm.segment import unlink_stale_segments

__all__ = ["StoreProcess"]

_READY_S = 30.0


@dataclass
class StoreProcess:
    """One store owner process, ready: its owner id, socket, segment and (a peer's) URL."""

    process: ManagedProcess
    owner_id: str
    socket: Path
    segment: str
    url: str | None  # a block peer's HTTP URL; None for ``python -m shm``

    @classmethod
    def start(cls, workdir: Path, *, block_bytes: int, capacity_bytes: int,
              owner_id: str | None = None, socket: Path | None = None, peer: bool = False,
              args: Sequence[str] = (), env: Mapping[str, str] | None = None,
              log_level: str = "warning", wait_s: float = _READY_S) -> StoreProcess:
        """Start an owner (a fresh ``owner_id`` unless given; its socket in ``workdir``
        unless given) with ``args`` after the geometry, and wait until it serves."""
        owner_id = owner_id or f"s{uuid.uuid4().hex[:10]}"
        socket = socket or workdir / f"{owner_id}.sock"
        argv = store_owner_argv(owner_id, socket, capacity_bytes=capacity_bytes,
                                block_bytes=block_bytes, peer=peer, log_level=log_level,
                                extra=args)
        process = ManagedProcess.start(f"store-{owner_id}", argv, workdir=workdir, env=env)
        ready = process.wait_ready(wait_s)[0]
        return cls(process, owner_id, Path(ready["socket"]), str(ready["segment"]),
                   ready.get("url"))

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The process itself (to signal it: a crash, a pause)."""
        return self.process.proc

    def stop(self) -> int:
        """SIGCONT (it may be paused), SIGTERM, SIGKILL if it lingers; then unlink what a
        killed owner left, as its restarted successor would. Its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        code = self.process.stop()
        unlink_stale_segments(self.owner_id)
        return code

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
