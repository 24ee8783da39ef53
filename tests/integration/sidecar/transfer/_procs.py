"""Block peers as real processes: ``python -m sidecar.transfer`` on ephemeral ports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shm import BlockStoreClient, StoreStats
from shm.segment import unlink_stale_segments
from tests.support.processes import read_line
from tests.support.transfer_peers import content

ROOT = Path(__file__).resolve().parents[4]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
READY_S = 30.0


@dataclass
class PeerProcess:
    proc: subprocess.Popen[str]
    url: str
    socket: Path
    owner_id: str
    block_bytes: int

    @classmethod
    def start(
        cls, tmp: Path, *, num_slots: int, block_bytes: int, extra: tuple[str, ...] = ()
    ) -> PeerProcess:
        owner_id = f"p{uuid.uuid4().hex[:10]}"
        sock = tmp / f"{owner_id}.sock"
        with (tmp / f"{owner_id}.log").open("w") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sidecar.transfer",
                    "--owner-id",
                    owner_id,
                    "--socket",
                    str(sock),
                    "--capacity-bytes",
                    str(num_slots * block_bytes),
                    "--block-bytes",
                    str(block_bytes),
                    "--port",
                    "0",
                    "--log-level",
                    "warning",
                    *extra,
                ],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=ENV,
                cwd=ROOT,
            )
        try:
            line = read_line(proc, READY_S)
        except AssertionError:
            proc.kill()
            raise
        if not line:
            proc.wait()
            raise AssertionError(
                f"peer {owner_id} exited {proc.returncode}: "
                f"{(tmp / f'{owner_id}.log').read_text()[-2000:]}"
            )
        ready = json.loads(line)
        return cls(proc, ready["url"], sock, owner_id, block_bytes)

    def client(self) -> BlockStoreClient:
        return BlockStoreClient(self.socket, expected_owner_id=self.owner_id)

    def seed(self, keys: list[tuple[int, int]]) -> None:
        with self.client() as store:
            assert all(store.put_many(keys, [content(k, self.block_bytes) for k in keys]))

    def stats(self) -> StoreStats:
        with self.client() as store:
            return store.stats()

    def read(self, keys: list[tuple[int, int]]) -> list[np.ndarray | None]:
        outs = [np.empty(self.block_bytes, dtype=np.uint8) for _ in keys]
        with self.client() as store:
            hits = store.get_many(keys, outs)
        return [o if hit else None for o, hit in zip(outs, hits, strict=True)]

    def stop(self) -> None:
        """SIGTERM (SIGCONT first, in case it is stopped), then wait; SIGKILL if stuck.

        Then remove what a killed owner left, as its restarted successor would.
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        # A SIGKILLed owner cannot unlink its segment; its successor would (README).
        unlink_stale_segments(self.owner_id)
