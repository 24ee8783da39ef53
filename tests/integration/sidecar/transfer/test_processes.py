"""Sidecar-to-sidecar imports between real processes, and what survives when one dies."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from shm.owner.local import LocalSession
from sidecar.transfer import PeerUnavailableError, TransferTimeoutError, Transport
from tests.integration.sidecar.transfer._procs import ENV, PeerProcess
from tests.support.polling import wait_for, wait_until
from tests.support.transfer_peers import PeerFactory, assert_untouched, content, transports

pytestmark = pytest.mark.slow  # real processes, seconds a test

KEYS = [(11, i) for i in range(16)]
STALLED = Path(__file__).with_name("_stalled_importer.py")
Spawn = Callable[..., PeerProcess]


@pytest.mark.parametrize("transport", transports())
async def test_peer_process_imports_blocks_byte_exact(spawn: Spawn, transport: Transport) -> None:
    """Sidecar B pulls from sidecar A by shm, NIXL or TCP; B's store then holds A's bytes."""
    if transport is Transport.NIXL:
        pytest.importorskip("nixl_cu12", reason="the nixl extra is not installed")
    exporter, importer = spawn(), spawn()
    await asyncio.to_thread(exporter.seed, KEYS)
    body = {
        "peer_url": exporter.url,
        "keys": [list(k) for k in KEYS],
        "transport": transport.value,
        "timeout_s": 30,
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{importer.url}/v1/blocks/pull", json=body) as resp,
    ):
        result = await resp.json()
    assert resp.status == 200, result
    assert result["imported"] == [list(k) for k in KEYS]
    blocks = await asyncio.to_thread(importer.read, KEYS)
    for key, block in zip(KEYS, blocks, strict=True):
        assert block is not None
        np.testing.assert_array_equal(block, content(key, importer.block_bytes))
    await asyncio.to_thread(
        wait_until,
        lambda: exporter.stats().num_leased_blocks == 0,
        "the exporter's leases to be given back",
    )


async def test_killed_exporter_mid_stream_fails_cleanly(
    spawn: Spawn, make_peer: PeerFactory
) -> None:
    """SIGKILL of the exporter mid-TCP-stream: PeerUnavailableError, nothing half-visible."""
    keys = [(12, i) for i in range(48)]
    exporter = spawn(num_slots=48, block_bytes=2 << 20)
    await asyncio.to_thread(exporter.seed, keys)
    importer = await make_peer(num_slots=64, block_bytes=2 << 20)
    pull = asyncio.create_task(importer.service.pull(exporter.url, keys, transport=Transport.TCP))
    await wait_for(
        lambda: importer.service.stats().num_stream_bytes_received > 0 or pull.done(),
        "the stream to start",
    )
    exporter.proc.send_signal(signal.SIGKILL)
    with pytest.raises(PeerUnavailableError, match="broke after"):
        await pull
    assert_untouched(importer)
    # The importer keeps serving: a pull from a live peer works.
    other = spawn(num_slots=8, block_bytes=2 << 20)
    await asyncio.to_thread(other.seed, keys[:4])
    result = await importer.service.pull(other.url, keys[:4], transport=Transport.TCP)
    assert result.imported == tuple(keys[:4])
    assert importer.read(keys[0]) is not None


@pytest.mark.nixl
async def test_killed_exporter_mid_nixl_read_fails_cleanly(
    spawn: Spawn, make_peer: PeerFactory
) -> None:
    """SIGKILL of the exporter while our NIXL READ runs: the pull fails, nothing visible."""
    pytest.importorskip("nixl_cu12", reason="the nixl extra is not installed")
    keys = [(14, i) for i in range(48)]
    exporter = spawn(num_slots=48, block_bytes=2 << 20)
    await asyncio.to_thread(exporter.seed, keys)
    importer = await make_peer(num_slots=64, block_bytes=2 << 20)
    await importer.service.pull(exporter.url, keys[:1], transport=Transport.NIXL)  # meet it
    with LocalSession(importer.owner) as session:
        session.remove(keys[:1])
    offers = importer.service.stats().num_offers_received
    pull = asyncio.create_task(
        importer.service.pull(exporter.url, keys, transport=Transport.NIXL, timeout_s=10)
    )
    await wait_for(
        lambda: importer.service.stats().num_offers_received > offers or pull.done(),
        "the export offer",
    )
    exporter.proc.send_signal(signal.SIGKILL)
    with pytest.raises((PeerUnavailableError, TransferTimeoutError)) as info:
        await pull
    assert "agent" in str(info.value) or isinstance(info.value, TransferTimeoutError)
    assert_untouched(importer)


@pytest.mark.parametrize("transport", transports())
async def test_stopped_exporter_times_out_and_its_leases_lapse(
    spawn: Spawn, make_peer: PeerFactory, transport: Transport
) -> None:
    """A frozen exporter: the pull times out with nothing imported; thawed, it frees leases."""
    if transport is Transport.NIXL:
        pytest.importorskip("nixl_cu12", reason="the nixl extra is not installed")
    exporter = spawn()
    await asyncio.to_thread(exporter.seed, KEYS)
    importer = await make_peer(num_slots=32, block_bytes=1 << 20)
    exporter.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(TransferTimeoutError):
            await importer.service.pull(exporter.url, KEYS, transport=transport, timeout_s=1.0)
    finally:
        exporter.proc.send_signal(signal.SIGCONT)
    assert_untouched(importer)
    if transport is not Transport.SHM:  # the export request waited in the socket: served late
        await asyncio.to_thread(
            wait_until,
            lambda: exporter.stats().num_hits == len(KEYS),
            "the late export to lease the blocks",
        )
    await asyncio.to_thread(
        wait_until,
        lambda: exporter.stats().num_leased_blocks == 0,
        "the exporter's leases to lapse",
    )


@pytest.mark.parametrize("transport", [Transport.TCP, Transport.SHM])
async def test_killed_importer_releases_the_exporters_leases(
    make_peer: PeerFactory, transport: Transport
) -> None:
    """SIGKILL of an importer holding leases mid-pull: the exporter releases them at once."""
    keys = [(13, i) for i in range(48)]
    block_bytes = 1 << 20
    exporter = await make_peer(num_slots=48, block_bytes=block_bytes)
    exporter.put(keys)
    target = exporter.url if transport is Transport.TCP else str(exporter.owner.config.socket_path)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(STALLED),
        transport.value,
        target,
        "13",
        str(len(keys)),
        str(block_bytes),
        stdout=asyncio.subprocess.PIPE,
        env=ENV,
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):  # (unconfigured structlog also writes to stdout)
            while (line := await proc.stdout.readline()).strip() != b"stalled":
                assert line, "the stalled importer exited early"
        assert exporter.owner.stats().num_leased_blocks == len(keys)
        proc.kill()
        await wait_for(
            lambda: exporter.owner.stats().num_leased_blocks == 0,
            "the exporter's leases to be released",
            timeout_s=10,
        )
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
    assert exporter.service.stats().num_exports_open == 0
    # The exporter keeps serving.
    other = await make_peer(num_slots=8, block_bytes=block_bytes)
    result = await other.service.pull(exporter.url, keys[:2], transport=transport)
    assert result.imported == tuple(keys[:2])
