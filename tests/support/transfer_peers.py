"""In-process peers for transfer tests: a block store owner, its transfer service, HTTP.

The ``make_peer`` fixture (tests/conftest.py) hands out ``started_peers``' factory; the
test modules import ``Peer``, ``PeerFactory``, ``content`` and ``assert_untouched`` here.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from kvcore.events import KVEvent
from shm import BlockStoreOwner, OwnerConfig
from shm.block_names import BlockNames
from shm.owner.local import LocalSession
from sidecar.transfer import BlockTransferService, TransferConfig, Transport

__all__ = [
    "BLOCK_BYTES",
    "Peer",
    "PeerFactory",
    "assert_untouched",
    "content",
    "started_peers",
    "transports",
]

BLOCK_BYTES = 64 << 10


def content(key: tuple[int, int], block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    """Deterministic bytes for a key, so any two copies can be compared."""
    return np.random.default_rng(list(key)).integers(0, 256, block_bytes, dtype=np.uint8)


def transports(chosen: Iterable[Transport] = Transport) -> list[Any]:
    """``chosen`` as test parameters, NIXL's marked ``nixl`` (``-m nixl`` selects it)."""
    return [pytest.param(t, marks=pytest.mark.nixl) if t is Transport.NIXL else t for t in chosen]


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


PeerFactory = Callable[..., Awaitable[Peer]]


def assert_untouched(peer: Peer) -> None:
    """Nothing visible, nothing reserved, nothing leased."""
    stats = peer.owner.stats()
    assert (stats.num_blocks, stats.num_reserved, stats.num_leased_blocks) == (0, 0, 0)


@asynccontextmanager
async def started_peers(sock_dir: Path) -> AsyncIterator[PeerFactory]:
    """Start peers (owner + service + HTTP on port 0); all are stopped on exit."""
    started: list[Peer] = []
    session = aiohttp.ClientSession()

    async def factory(num_slots: int = 16, block_bytes: int = BLOCK_BYTES,
                      names: BlockNames | None = None, **config: object) -> Peer:
        owner_id = f"t{uuid.uuid4().hex[:10]}"
        events: list[KVEvent] = []
        owner = BlockStoreOwner(
            OwnerConfig(owner_id=owner_id, socket_path=sock_dir / f"{owner_id}.sock",
                        capacity_bytes=num_slots * block_bytes, block_bytes=block_bytes),
            listener=events.append, names=names)
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

    try:
        yield factory
    finally:
        for peer in reversed(started):
            await peer.runner.cleanup()
            await peer.service.aclose()
            await peer.owner.aclose()
        await session.close()
