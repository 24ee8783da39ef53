"""Suite-wide fixtures."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest

from tests.support import tiny_model
from tests.support.polling import wait_until

if TYPE_CHECKING:
    from tests.support.transfer_peers import PeerFactory

_SHM_DIR = Path("/dev/shm")
_SHM_PREFIX = "kvsidecar-"
_SHM_GRACE_S = 5.0


def _our_segments() -> set[str]:
    try:
        return {p.name for p in _SHM_DIR.iterdir() if p.name.startswith(_SHM_PREFIX)}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_leaked_shm_segments() -> Iterator[None]:
    """Fail a test that leaves a /dev/shm/kvsidecar-* segment behind.

    Only segments that appeared during the test count (another suite on this host may hold
    its own), and processes the test stopped get a short grace period to finish unlinking.
    """
    before = _our_segments()
    yield

    def none_leaked() -> bool:
        leaked = _our_segments() - before
        assert not leaked, f"shared-memory segments left in /dev/shm: {sorted(leaked)}"
        return True

    wait_until(none_leaked, "the test's segments to be unlinked", _SHM_GRACE_S, 0.05)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-3-style model directory with a small trained BPE tokenizer."""
    return tiny_model.write_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for Unix sockets (their paths must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kvs-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def make_peer(sock_dir: Path) -> AsyncIterator[PeerFactory]:
    """In-process transfer peers (owner, service, HTTP on port 0), stopped after the test."""
    from tests.support.transfer_peers import started_peers  # only the transfer suites load it

    async with started_peers(sock_dir) as factory:
        yield factory


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """One aiohttp client session for the test, closed after it."""
    async with aiohttp.ClientSession() as s:
        yield s
