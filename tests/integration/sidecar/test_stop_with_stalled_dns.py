"""A sidecar stops cleanly while one of libzmq's name lookups never answers.

libzmq resolves an endpoint's host in its I/O thread, and ``zmq_ctx_term`` waits for that
thread. In a compose stack the DNS server stalled during ``stop``, and a sidecar sat 30 s in
``term``, past its grace: SIGKILL, exit 137. Here the stall is deterministic. The sidecar runs
in a mount namespace of its own (``unshare -m``), whose ``/etc/resolv.conf`` names a UDP
socket of this test that takes every query and answers none. It subscribes to events at a
host of that name, so the lookup is under way when SIGTERM comes: the sidecar must still exit
0, and say that it left the term to finish in the background.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsidecar.launch import ManagedProcess
from kvsidecar.stack_argv import sidecar_argv
from tests.support.processes import ProcessGroup

SILENT_DNS = "127.0.0.77"
# Own resolv.conf, then the sidecar: ``sh -c SCRIPT RESOLV_CONF python -m sidecar ...``.
IN_OWN_MOUNTS = ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/resolv.conf && exec "$@"']

pytestmark = pytest.mark.slow


@pytest.fixture
def silent_resolv_conf(tmp_path: Path) -> Iterator[Path]:
    """A resolv.conf whose one server (a socket here) never answers: each lookup then waits
    5 attempts of 30 s, far past the sidecar's stop."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare, for a mount namespace with its own resolv.conf")
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("this machine refuses a new mount namespace (unshare -m)")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind((SILENT_DNS, 53))  # root on Linux: all of 127/8 is loopback
        conf = tmp_path / "resolv.conf"
        conf.write_text(f"nameserver {SILENT_DNS}\noptions timeout:30 attempts:5\n")
        yield conf


async def test_sigterm_ends_the_sidecar_while_an_event_host_lookup_hangs(
    tmp_path: Path, procs: ProcessGroup[ManagedProcess], standin: str,
    silent_resolv_conf: Path,
) -> None:
    argv = sidecar_argv(standin, "w", "agg", 0.0, [
        "--engine", "trtllm", "--model-id", "m", "--block-size", "16",
        "--kv-events-endpoint", "tcp://kv-events.stalled.invalid:5557"])
    sidecar = procs.add(ManagedProcess.start(
        "sidecar", ["sidecar", *argv], workdir=tmp_path,
        prefix=[*IN_OWN_MOUNTS, str(silent_resolv_conf)]))
    await asyncio.to_thread(sidecar.wait_ready, 60)
    # Without close_context, term would wait out the lookup (minutes) and stop() SIGKILLs.
    code = await asyncio.to_thread(sidecar.stop, 60)
    log = sidecar.log_path.read_text()
    assert code == 0, log[-4000:]
    assert '"zmq_context_term_slow"' in log and '"sidecar_stopped"' in log, log[-4000:]
