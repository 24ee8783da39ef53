"""The disk tier through real processes: ``python -m shm`` and the sidecar (with the reference
engine) restarted on the same directory; a gateway feed sees the ``disk`` tier."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from adapters.sglang.hicache_keys import HiCacheKeyMap
from kvcore.events import Tier
from kvsidecar.local_stack import LocalStack
from refengine.page_hash import page_digests
from routing.placement.kv_router import KvRouter
from routing.workers.event_feed import SidecarFeed
from shm import BlockStoreClient
from shm.tiers.disk_format import HEADER_BYTES
from tests.support.polling import eventually, wait_until
from tests.support.store_owner import OwnerProcess, owner_config
from tests.support.tier_stack import (
    PAGE_BYTES,
    PAGE_TOKENS,
    generate,
    hook_attached,
    replica,
    tier_spec,
)

BLOCK = 4096


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)


def held(feed: SidecarFeed, tier: Tier) -> int:
    """Blocks the gateway's index holds for worker r0 in ``tier`` (0 before its first)."""
    index = feed.router.index
    return index.num_blocks("r0", tier) if "r0" in index.worker_ids else 0


def agree(feed: SidecarFeed, store: BlockStoreClient) -> bool:
    stats = store.stats()
    return (held(feed, Tier.DISK), held(feed, Tier.HOST)) == (
        stats.num_disk_blocks, stats.num_blocks)


def put_one_by_one(store: BlockStoreClient, keys: list[tuple[int, int]]) -> None:
    for i, key in enumerate(keys):  # the store evicts the oldest as it fills
        assert store.put(key, data(i)) is True


@pytest.mark.slow  # real processes, seconds a test
def test_owner_process_keeps_evicted_blocks_across_a_restart(
        sock_dir: Path, tmp_path: Path) -> None:
    """Blocks evicted from a 4-slot store come back byte-exact, before and after the owner
    process is restarted on the same directory; a corrupt file is a miss, not garbage."""
    disk = tmp_path / "disk"
    cfg = replace(owner_config(sock_dir, BLOCK, num_slots=4), disk_dir=disk,
                  disk_capacity_bytes=64 * (BLOCK + HEADER_BYTES))
    keys = [(3, 1000 + i) for i in range(10)]
    with OwnerProcess(cfg), BlockStoreClient(cfg.socket_path) as store:
        put_one_by_one(store, keys)
        wait_until(lambda: store.stats().num_disk_blocks >= 6, "6 blocks on disk")
        out = np.empty(BLOCK, np.uint8)
        assert (store.get(keys[0], out) == data(0)).all()
        assert store.stats().num_disk_reads == 1
    with OwnerProcess(cfg), BlockStoreClient(cfg.socket_path) as store:
        assert store.stats().num_disk_blocks >= 6
        for i in range(6):  # one at a time: 4 slots cannot hold 6 leased blocks at once
            assert (store.get(keys[i], np.empty(BLOCK, np.uint8)) == data(i)).all()
    victim = next(disk.glob("*.blk"))
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    ns, h = (int(part, 16) for part in victim.name.removesuffix(".blk").split("-"))
    with OwnerProcess(cfg), BlockStoreClient(cfg.socket_path) as store:
        assert store.contains((ns, h)) is True  # the check is on read
        assert store.get_many([(ns, h)], [np.zeros(BLOCK, np.uint8)]) == [False]
        stats = store.stats()
        assert stats.num_disk_corrupt == 1 and not store.contains((ns, h))


@pytest.mark.slow
async def test_a_sidecar_restart_reannounces_its_disk_tier(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    """Blocks the sidecar's store evicts are ``disk`` blocks on the gateway's feed, named as
    the engine's events name their pages, and a restarted sidecar on the same directory
    announces them again, named from the files alone."""
    # Keyed as the engine's HiCache hook keys them: by their pages' hashes. The engine's own
    # hook stays out of the store (store="sidecar"): the test writes it.
    tokens = [(i * 29 + 3) % 1000 for i in range(10 * PAGE_TOKENS + 1)]
    digests = [d.hex() for d in page_digests(tokens, PAGE_TOKENS)]
    keys = HiCacheKeyMap("tiny").store_keys(digests)
    spec = tier_spec(replica(
        "r0", "--store-capacity-bytes", str(4 * BLOCK), "--store-block-bytes", str(BLOCK),
        "--disk-tier-dir", str(tmp_path / "disk"), "--disk-tier-capacity-bytes", "1MiB",
        store="sidecar"))
    async with LocalStack(spec, tmp_path / "stack") as stack:
        eng_url, sock = stack.engine_urls["r0"], stack.store_sockets["r0"]
        sc = stack.process("sidecar-0")
        feed = SidecarFeed(sc.url, KvRouter(), session, model_id="tiny")
        task = asyncio.create_task(feed.run())
        try:
            await generate(session, eng_url, tokens)  # the engine's events name the 10 pages
            await eventually(lambda: held(feed, Tier.GPU) == 10, "the pages at the gateway")
            with BlockStoreClient(str(sock)) as store:
                put_one_by_one(store, keys)
                # At least the 6 that 4 slots cannot hold (a slot granted ahead holds none).
                wait_until(lambda: store.stats().num_disk_blocks >= 6, "6 blocks on disk")
                await eventually(lambda: agree(feed, store), "the gateway's feed to agree "
                                 "with the store on its host and disk tiers")
                on_disk = store.stats().num_disk_blocks
            async with session.get(f"{sc.url}/metrics") as resp:
                text = await resp.text()
            assert f'kvsidecar_disk_tier_held{{kind="blocks"}} {on_disk}.0' in text
            assert f'kvsidecar_disk_tier_blocks_total{{op="written"}} {on_disk}.0' in text
        finally:
            task.cancel()
        assert sc.stop() == 0, sc.log_tail()
        assert not sock.exists()
        sc = await asyncio.to_thread(stack.restart, sc)  # same arguments, same port
        feed = SidecarFeed(sc.url, KvRouter(), session, model_id="tiny")
        task = asyncio.create_task(feed.run())
        try:
            await eventually(lambda: held(feed, Tier.DISK) == on_disk,
                             "the restarted sidecar's disk tier on the gateway's feed")
            assert held(feed, Tier.HOST) == 0
            with BlockStoreClient(str(sock)) as store:
                out = np.empty(BLOCK, np.uint8)
                assert (store.get(keys[2], out) == data(2)).all()
            await eventually(lambda: held(feed, Tier.HOST) == 1,
                             "the promoted block in the gateway's host tier")
        finally:
            task.cancel()
        assert sc.stop() == 0, sc.log_tail()


@pytest.mark.slow
async def test_the_reference_engine_loads_its_prefix_back_through_disk(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    """The engine's pages, written through its HiCache hook into a 16-page store, are evicted
    to disk by a second prompt's; after a device flush the first prompt's prefill loads all
    12 pages from the store (engine-reported ``storage`` tokens), most through disk."""
    spec = tier_spec(replica(
        "r0", "--store-block-bytes", str(PAGE_BYTES), "--store-capacity-bytes",
        str(16 * PAGE_BYTES), "--disk-tier-dir", str(tmp_path / "disk"),
        "--disk-tier-capacity-bytes", "8MiB"))
    first = [(i * 37 + 11) % 1000 for i in range(12 * PAGE_TOKENS + 5)]
    second = [(i * 53 + 7) % 1000 for i in range(12 * PAGE_TOKENS + 5)]
    async with LocalStack(spec, tmp_path / "stack") as stack:
        eng_url = stack.engine_urls["r0"]
        with BlockStoreClient(str(stack.store_sockets["r0"])) as store:
            base = await hook_attached(session, eng_url, store)
            assert await generate(session, eng_url, first) == {}
            wait_until(lambda: store.stats().num_puts >= base + 12, "the first prompt's pages")
            await generate(session, eng_url, second)
            # 24 pages in 16 slots: at least the first prompt's 8 oldest are on disk only.
            wait_until(lambda: store.stats().num_puts >= base + 24
                       and store.stats().num_disk_blocks >= 8,
                       "the first prompt's pages on disk")
            assert store.stats().num_disk_reads == 0
            async with session.post(eng_url + "/flush_cache") as resp:
                assert resp.status == 200
            assert await generate(session, eng_url, first) == {"device": 0, "host": 0,
                                                                "storage": 12 * PAGE_TOKENS}
            assert store.stats().num_disk_reads >= 8
