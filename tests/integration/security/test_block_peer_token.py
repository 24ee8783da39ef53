"""Standalone block peers (``kvsidecar blocks``) behind a control token: a pull through an
importer reaches the exporter only with the token, and then moves the exact bytes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from kvcore.control_token import CONTROL_TOKEN_HEADER
from tests.integration.sidecar.transfer._procs import PeerProcess
from tests.support.processes import ProcessGroup
from tests.support.transfer_peers import content

pytestmark = pytest.mark.slow  # real processes, seconds a test

KEYS = [(31, i) for i in range(8)]
TOKEN = "ctl-peer-0b7d"


@pytest.fixture
def peers(sock_dir: Path) -> Iterator[tuple[PeerProcess, PeerProcess, PeerProcess]]:
    """An exporter and an importer sharing the token, and an importer without it."""
    token = sock_dir / "token"
    token.write_text(TOKEN + "\n")
    guarded = ("--control-token-file", str(token), "--no-nixl")
    with ProcessGroup[PeerProcess]() as group:
        yield (
            group.add(PeerProcess.start(sock_dir, num_slots=16, block_bytes=4096, extra=guarded)),
            group.add(PeerProcess.start(sock_dir, num_slots=16, block_bytes=4096, extra=guarded)),
            group.add(PeerProcess.start(sock_dir, num_slots=16, block_bytes=4096,
                                        extra=("--no-nixl",))),
        )


async def test_a_pull_needs_the_token_at_both_ends(
    peers: tuple[PeerProcess, PeerProcess, PeerProcess], session: aiohttp.ClientSession
) -> None:
    exporter, importer, stranger = peers
    await asyncio.to_thread(exporter.seed, KEYS)
    body = {"peer_url": exporter.url, "keys": [list(k) for k in KEYS], "transport": "tcp",
            "timeout_s": 30}
    ok = {CONTROL_TOKEN_HEADER: TOKEN}
    async with session.post(f"{importer.url}/v1/blocks/pull", json=body) as resp:
        assert resp.status == 401  # the importer itself is guarded
    async with session.post(f"{stranger.url}/v1/blocks/pull", json=body) as resp:
        result = await resp.json()
        # The stranger has no token: the exporter refuses it, and nothing is imported.
        assert resp.status == 502 and result["error"]["code"] == "peer_unauthorized", result
    assert await asyncio.to_thread(stranger.read, KEYS) == [None] * len(KEYS)
    async with session.post(f"{importer.url}/v1/blocks/pull", json=body, headers=ok) as resp:
        result = await resp.json()
        assert resp.status == 200, result
    assert result["imported"] == [list(k) for k in KEYS]
    blocks = await asyncio.to_thread(importer.read, KEYS)
    for key, block in zip(KEYS, blocks, strict=True):
        assert block is not None
        np.testing.assert_array_equal(block, content(key, importer.block_bytes))
