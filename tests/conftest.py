"""Suite-wide fixtures."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from tests.support import tiny_model
from tests.support.polling import wait_until

if TYPE_CHECKING:
    from tests.support.transfer_peers import PeerFactory

# scripts/test runs pytest-xdist (-n 2). Tests that start processes share host-wide names:
# shared-memory owner ids taken from worker ids ("replica-0": a second live owner with the
# same id is refused), podman images and containers, compose projects. They run as one unit,
# in file order, on one worker; the files under these paths (in process, ephemeral ports
# only) go to the other worker meanwhile, a file at a time.
_SPREAD = ("tests/unit/", "tests/test_structure.py", "tests/integration/gateway/")
# The podman tests build and run our images (minutes on a fresh machine) in IPC namespaces
# of their own, so they share no owner id with the host's stacks: one unit of their own,
# which a worker takes beside the host's.
_CONTAINERS = ("tests/integration/containers/test_cpu_stack.py",
               "tests/integration/containers/test_plugin_images.py")
# Process tests whose stacks hold no block store (so no owner id), on ephemeral ports, with
# no podman, compose, Redis, NATS or shared cache: one more unit beside the host's.
_NO_STORE = ("tests/engines/refengine/test_http_api.py",
             "tests/engines/sidecar/test_sidecar_sglang_load.py",
             "tests/integration/clients/test_anthropic_sdk.py",
             "tests/integration/clients/test_openai_sdk.py",
             "tests/integration/discovery/test_k8s_discovery.py",
             "tests/integration/epp/test_epp.py",
             "tests/integration/epp/test_epp_cli.py",
             "tests/integration/replay/test_live_replay.py",
             "tests/integration/sidecar/test_engine_credentials.py",
             "tests/integration/stack/test_field_matrix.py",
             "tests/integration/stack/test_parity.py")

_SHM_DIR = Path("/dev/shm")
_SHM_PREFIX = "kvsidecar-"
_SHM_GRACE_S = 5.0


def _our_segments() -> set[str]:
    try:
        return {p.name for p in _SHM_DIR.iterdir() if p.name.startswith(_SHM_PREFIX)}
    except FileNotFoundError:
        return set()


def _descends_from_us(pid: int) -> bool:
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rpartition(")")[2].split()[1])  # the parent's pid
    return False


def _held_elsewhere(name: str) -> bool:
    """Whether a process outside this test run maps the segment (another suite's owner)."""
    target = f"{_SHM_DIR}/{name}"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            held = target in (proc / "maps").read_text()
        except OSError:
            continue
        if held and not _descends_from_us(int(proc.name)):
            return True
    return False


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own --dist choice
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    # A scheduler, not xdist_group marks: pytest 9 ignores the node-id suffix those work by.
    from xdist.scheduler import LoadScopeScheduling

    class HostGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(_SPREAD):
                return nodeid.partition("::")[0]
            if nodeid.startswith(_CONTAINERS):
                return "containers"
            return "no-store" if nodeid.startswith(_NO_STORE) else "host"

    return HostGroupScheduling(config, log)


@pytest.fixture(autouse=True)
def no_leaked_shm_segments() -> Iterator[None]:
    """Fail a test that leaves a /dev/shm/kvsidecar-* segment behind.

    Only segments that appeared during the test count, and not those a process outside this
    run maps (another suite on this host may be running its own owners); processes the test
    stopped get a short grace period to finish unlinking.
    """
    before = _our_segments()
    yield

    def none_leaked() -> bool:
        leaked = {n for n in _our_segments() - before if not _held_elsewhere(n)}
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
