"""In-process peers for transfer tests: a block store owner, its transfer service, HTTP."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import uvloop
from aiohttp import web

from kvcore.events import KVEvent
from shm import BlockStoreOwner, OwnerConfig
from shm.local import LocalSession
from sidecar.transfer import BlockTransferService, TransferConfig

BLOCK_BYTES = 64 << 10


def content(key: tuple[int, int], block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    """Deterministic bytes for a key, so any two copies can be compared."""
    return np.random.default_rng(list(key)).integers(0, 256, block_bytes, dtype=np.uint8)


@dataclass
class Peer:
    owner: BlockStoreOwner
    service: BlockTransferService
    runner: web.AppRunner
    url: str
    events: list[KVEvent] = field(default_factory=list)

    def put(self, keys: list[tuple[int, int]]) -> None:
        """Store ``content(key)`` for each key through an in-process session."""
        with LocalSession(self.owner) as session:
            reply = session.reserve(keys)
            slots = [s for s in reply.slots if s is not None]
            gens = [g for g in reply.generations if g is not None]
            for key, slot in zip(keys, reply.slots, strict=True):
                if slot is not None:
                    session.rows[slot] = content(key, session.block_bytes)
            session.commit(slots, gens)

    def read(self, key: tuple[int, int]) -> np.ndarray | None:
        """A copy of a held block's bytes, or ``None``."""
        with LocalSession(self.owner) as session:
            reply = session.lease([key])
            slot = reply.slots[0]
            return None if slot is None else session.rows[slot].copy()


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Run every transfer test on the stdlib loop and on uvloop (the sidecar's loop)."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvt-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


PeerFactory = Callable[..., Awaitable[Peer]]


@pytest.fixture
async def make_peer(sock_dir: Path) -> AsyncIterator[PeerFactory]:
    """Start peers (owner + service + HTTP on port 0); all are stopped after the test."""
    started: list[Peer] = []
    session = aiohttp.ClientSession()

    async def factory(num_slots: int = 16, block_bytes: int = BLOCK_BYTES,
                      **config: object) -> Peer:
        owner_id = f"t{uuid.uuid4().hex[:10]}"
        events: list[KVEvent] = []
        owner = BlockStoreOwner(
            OwnerConfig(owner_id=owner_id, socket_path=sock_dir / f"{owner_id}.sock",
                        capacity_bytes=num_slots * block_bytes, block_bytes=block_bytes),
            listener=events.append)
        await owner.start()
        service = BlockTransferService(owner, session, TransferConfig(**config))  # type: ignore[arg-type]
        await service.start()
        app = web.Application()
        app.add_routes(service.routes())
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = next(a for a in runner.addresses if isinstance(a, tuple))[1]
        peer = Peer(owner, service, runner, f"http://127.0.0.1:{port}", events)
        started.append(peer)
        return peer

    yield factory
    for peer in reversed(started):
        await peer.runner.cleanup()
        await peer.service.aclose()
        await peer.owner.aclose()
    await session.close()
