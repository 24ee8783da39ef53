"""The KV handoff's transfer time per 1,000 tokens, per transport (for ``bench_disagg.py``).

Two in-process peers (a block store owner, its ``BlockTransferService`` and HTTP routes
each), as two sidecars on one host would be. The exporter holds the KV of 1,008 tokens (63
blocks of 16 tokens) keyed as the engines' HiCache hook keys pages; each round the importer
pulls them through ``TransferServiceHandoff`` (the decode sidecar's handoff), then drops them
again. A numpy copy of the same bytes between the two segments is the floor. The same
blocks pulled in groups of 8 (one pull after another) show what block-group pipelining would
pay per group.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import numpy as np
from aiohttp import web

from adapters.sglang.hicache_keys import HiCacheKeyMap, ShardCoordinates
from shm import BlockStoreOwner, OwnerConfig
from shm.owner.local import LocalSession
from sidecar.pd_handoff import TransferServiceHandoff
from sidecar.transfer import BlockTransferService, TransferConfig

__all__ = ["LAYOUTS", "measure_transfer"]

TOKENS_PER_BLOCK = 16
BLOCKS = 63  # 1,008 tokens
GROUP = 8  # blocks per pull when measuring block-group pulls
# bytes of KV per token: layers × 2 (K, V) × kv heads × head dim × dtype bytes
LAYOUTS = {
    "tiny": 4 * 2 * 2 * 32 * 4,  # the reference engine's shipped model (fp32)
    "8b": 32 * 2 * 8 * 128 * 2,  # a Llama-3-8B-class model (bf16): 128 KiB per token
}


class _Peer:
    def __init__(self, owner: BlockStoreOwner, service: BlockTransferService,
                 runner: web.AppRunner, url: str) -> None:
        self.owner, self.service, self.runner, self.url = owner, service, runner, url


async def _peer(tmp: Path, session: aiohttp.ClientSession, block_bytes: int) -> _Peer:
    owner_id = f"bd{uuid.uuid4().hex[:10]}"
    owner = BlockStoreOwner(OwnerConfig(owner_id=owner_id, socket_path=tmp / f"{owner_id}.sock",
                                        capacity_bytes=(BLOCKS + 1) * block_bytes,
                                        block_bytes=block_bytes))
    await owner.start()
    service = BlockTransferService(owner, session, TransferConfig())
    await service.start()
    app = web.Application()
    app.add_routes(service.routes())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = next(a for a in runner.addresses if isinstance(a, tuple))[1]
    return _Peer(owner, service, runner, f"http://127.0.0.1:{port}")


async def _close(peer: _Peer) -> None:
    await peer.runner.cleanup()
    await peer.service.aclose()
    await peer.owner.aclose()


async def _measure_layout(tmp: Path, bytes_per_token: int, transports: list[str],
                          rounds: int) -> dict[str, float]:
    """Median ms to move 1,000 tokens of KV, per transport and for the memcpy floor."""
    block_bytes = bytes_per_token * TOKENS_PER_BLOCK
    page_keys = [os.urandom(32).hex() for _ in range(BLOCKS)]
    out: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        exporter = await _peer(tmp, session, block_bytes)
        importer = await _peer(tmp, session, block_bytes)
        try:
            key_map = HiCacheKeyMap("tiny", ShardCoordinates())  # as the decode sidecar keys
            handoff = TransferServiceHandoff(importer.service, key_map.store_keys)
            keys = key_map.store_keys(page_keys)
            with LocalSession(exporter.owner) as s:
                reply = s.reserve(keys)
                slots = [x for x in reply.slots if x is not None]
                for slot in slots:
                    s.rows[slot] = np.random.default_rng(slot).integers(
                        0, 256, block_bytes, dtype=np.uint8)
                s.commit(slots, [g for g in reply.generations if g is not None])
            scale = 1000 / (BLOCKS * TOKENS_PER_BLOCK)
            for transport in transports:
                times = []
                for i in range(rounds + 1):
                    result = await handoff.pull(exporter.url, page_keys, transport=transport,
                                                timeout_s=30)
                    assert result.blocks == BLOCKS
                    if i:  # the first round touches fresh memory
                        times.append(result.seconds)
                    with LocalSession(importer.owner) as s:
                        s.remove(keys)
                out[transport] = statistics.median(times) * scale * 1e3
            # Block-group pipelining would pull each group as the prefill writes it: what
            # does splitting one pull into groups of GROUP blocks cost (shm, one after another)?
            times = []
            for i in range(rounds + 1):
                t = time.perf_counter()
                for g in range(0, BLOCKS, GROUP):
                    await handoff.pull(exporter.url, page_keys[g:g + GROUP], transport="shm",
                                       timeout_s=30)
                if i:
                    times.append(time.perf_counter() - t)
                with LocalSession(importer.owner) as s:
                    s.remove(keys)
            out[f"shm_groups_of_{GROUP}"] = statistics.median(times) * scale * 1e3
            with LocalSession(exporter.owner) as src, LocalSession(importer.owner) as dst:
                lease = src.lease(keys)
                reply = dst.reserve(keys)
                times = []
                for _ in range(rounds):
                    t = time.perf_counter()
                    for a, b in zip(lease.slots, reply.slots, strict=True):
                        dst.rows[b][:] = src.rows[a]
                    times.append(time.perf_counter() - t)
                out["memcpy"] = statistics.median(times) * scale * 1e3
                dst.abort([x for x in reply.slots if x is not None],
                          [g for g in reply.generations if g is not None])
                src.release([x for x in lease.slots if x is not None],
                            [g for g in lease.generations if g is not None])
        finally:
            await _close(importer)
            await _close(exporter)
    return out


async def measure_transfer(transports: list[str], rounds: int = 5) -> dict[str, dict[str, float]]:
    """{layout: {transport | "memcpy": ms per 1,000 tokens}}."""
    with tempfile.TemporaryDirectory(prefix="kvbd-") as tmp:
        return {name: await _measure_layout(Path(tmp), bpt, transports, rounds)
                for name, bpt in LAYOUTS.items()}
