"""Fixtures for transfer tests across processes (in-process peers: the make_peer fixture)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.sidecar.transfer._procs import PeerProcess
from tests.support.processes import ProcessGroup


@pytest.fixture
def spawn(sock_dir: Path) -> Iterator[Callable[..., PeerProcess]]:
    """Start peer processes; every one is stopped (and its shm unlinked) after the test."""
    with ProcessGroup[PeerProcess]() as started:

        def factory(
            num_slots: int = 32, block_bytes: int = 1 << 20, extra: tuple[str, ...] = ()
        ) -> PeerProcess:
            return started.add(
                PeerProcess.start(sock_dir, num_slots=num_slots, block_bytes=block_bytes,
                                  extra=extra)
            )

        yield factory
