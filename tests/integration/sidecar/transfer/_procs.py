"""Block peers as real processes: ``python -m sidecar.transfer`` on ephemeral ports, started
by ``kvsidecar.local_store`` (as ``scripts/bench_transfer.py`` starts its exporter)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsidecar.local_store import StoreProcess
from shm import BlockStoreClient, StoreStats
from tests.support.transfer_peers import content

ROOT = Path(__file__).resolve().parents[4]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@dataclass
class PeerProcess:
    store: StoreProcess
    url: str
    block_bytes: int

    @classmethod
    def start(
        cls, tmp: Path, *, num_slots: int, block_bytes: int, extra: tuple[str, ...] = ()
    ) -> PeerProcess:
        store = StoreProcess.start(tmp, peer=True, block_bytes=block_bytes,
                                   capacity_bytes=num_slots * block_bytes, args=extra,
                                   env={"PYTHONPATH": str(ROOT)})
        assert store.url is not None
        return cls(store, store.url, block_bytes)

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.store.proc

    @property
    def socket(self) -> Path:
        return self.store.socket

    @property
    def owner_id(self) -> str:
        return self.store.owner_id

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
        """SIGTERM (SIGCONT first, in case it is stopped); SIGKILL if stuck. Then remove
        what a killed owner left, as its restarted successor would (README)."""
        self.store.stop()
