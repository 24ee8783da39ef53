"""Two replicas of one model share a prefix through ``redis-server``: the reference engine
of the second loads the first's pages through its sidecar's remote tier and computes only
the rest; the gateway's feeds credit those blocks as ``remote`` on both workers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from kvcore.events import Tier
from kvsidecar.local_stack import LocalStack
from routing.placement.kv_router import KvRouter
from routing.workers.event_feed import SidecarFeed
from shm import BlockStoreClient
from tests.support.polling import eventually, wait_until
from tests.support.tier_stack import (
    PAGE_BYTES,
    PAGE_TOKENS,
    generate,
    hook_attached,
    replica,
    tier_spec,
)


def remote_blocks(feed: SidecarFeed, worker: str) -> int:
    index = feed.router.index
    return index.num_blocks(worker, Tier.REMOTE) if worker in index.worker_ids else 0


@pytest.mark.slow
async def test_a_prefix_computed_on_one_replica_is_loaded_on_another(
        tmp_path: Path, session: aiohttp.ClientSession) -> None:
    prompt = [(i * 37 + 11) % 1000 for i in range(12 * PAGE_TOKENS + 5)]
    store = ("--store-block-bytes", str(PAGE_BYTES), "--store-capacity-bytes",
             str(64 * PAGE_BYTES))
    spec = tier_spec(replica("r0", *store), replica("r1", *store), redis=True)
    async with LocalStack(spec, tmp_path) as stack:
        feeds = [SidecarFeed(stack.sidecar_urls[name], KvRouter(), session, model_id="tiny")
                 for name in ("r0", "r1")]
        tasks = [asyncio.create_task(feed.run()) for feed in feeds]
        eng0, eng1 = (stack.engine_urls[name] for name in ("r0", "r1"))
        sock0, sock1 = (stack.store_sockets[name] for name in ("r0", "r1"))
        sc1 = stack.sidecar_urls["r1"]
        try:
            with BlockStoreClient(str(sock0)) as store0, BlockStoreClient(str(sock1)) as store1:
                wait_until(lambda: store0.stats().remote_connected
                           and store1.stats().remote_connected, "both tiers connected")
                base0 = await hook_attached(session, eng0, store0)
                await hook_attached(session, eng1, store1)
                assert await generate(session, eng0, prompt) == {}
                wait_until(lambda: store0.stats().num_puts >= base0 + 12, "the prompt's pages")
                # Written through to the shared store, and so in replica 1's index.
                wait_until(lambda: store1.stats().num_remote_blocks
                           >= store0.stats().num_remote_writes >= 12, "replica 1's index")
                for feed, worker in ((feeds[0], "r0"), (feeds[1], "r1")):
                    await eventually(lambda f=feed, w=worker: remote_blocks(f, w)  # type: ignore[misc]
                                     == store1.stats().num_remote_blocks,
                                     f"the gateway crediting {worker}'s remote tier")
                # Replica 1 never saw the prompt: its engine loads 12 pages from storage.
                assert await generate(session, eng1, prompt) == {
                    "device": 0, "host": 0, "storage": 12 * PAGE_TOKENS}
                assert store1.stats().num_remote_reads >= 12
            async with session.get(f"{sc1}/metrics") as resp:
                text = await resp.text()
            assert 'kvsidecar_remote_tier_held{kind="connected"} 1.0' in text
            assert 'kvsidecar_remote_tier_blocks_total{op="read"}' in text
        finally:
            for task in tasks:
                task.cancel()
