"""Fixtures for transfer tests across processes."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.sidecar.transfer._procs import PeerProcess
from tests.unit.sidecar.transfer.conftest import make_peer, sock_dir

__all__ = ["make_peer", "sock_dir"]


@pytest.fixture
def tmp_short() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvp-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def spawn(tmp_short: Path) -> Iterator[Callable[..., PeerProcess]]:
    """Start peer processes; every one is stopped (and its shm unlinked) after the test."""
    started: list[PeerProcess] = []

    def factory(
        num_slots: int = 32, block_bytes: int = 1 << 20, extra: tuple[str, ...] = ()
    ) -> PeerProcess:
        peer = PeerProcess.start(
            tmp_short, num_slots=num_slots, block_bytes=block_bytes, extra=extra
        )
        started.append(peer)
        return peer

    yield factory
    for peer in started:
        peer.stop()
