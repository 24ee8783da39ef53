"""Suite-wide fixtures."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import tiny_model

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
    deadline = time.monotonic() + _SHM_GRACE_S
    while (leaked := _our_segments() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not leaked, f"shared-memory segments left in /dev/shm: {sorted(leaked)}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-3-style model directory with a small trained BPE tokenizer."""
    return tiny_model.write_model_dir(tmp_path_factory.mktemp("tiny-model"))
