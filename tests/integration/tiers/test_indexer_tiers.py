"""The gateway's KV indexer API counts each medium: a prompt written through to a sidecar's
host-tier store is ``CPU`` beside ``GPU``, and still ``CPU`` (and ``longest_matched``) once the
engine's GPU copy is flushed; real engine, sidecar, store and gateway processes."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from kvsidecar.local_stack import GatewaySpec, LocalStack
from shm import BlockStoreClient
from tests.support.gateway import routable
from tests.support.polling import eventually
from tests.support.tier_stack import PAGE_BYTES, PAGE_TOKENS, hook_attached, replica, tier_spec

pytestmark = pytest.mark.slow

PROMPT = [(i * 29 + 7) % 1000 + 5 for i in range(8 * PAGE_TOKENS + 3)]  # 8 full blocks
FULL = 8 * PAGE_TOKENS


async def test_host_tier_blocks_answer_as_cpu(tmp_path: Path,
                                              session: aiohttp.ClientSession) -> None:
    """GPU and CPU both hold the prompt after it ran; after a GPU flush only CPU does, and
    longest_matched still counts it."""
    spec = tier_spec(replica("A", "--store-capacity-bytes", str(64 * PAGE_BYTES)),
                     gateways=(GatewaySpec(wait_routable=False),))
    async with LocalStack(spec, tmp_path) as stack:
        engine_url, gateway_url = stack.engine_urls["A"], stack.url
        await routable(session, gateway_url, 1)
        with BlockStoreClient(str(stack.store_sockets["A"])) as store:
            await hook_attached(session, engine_url, store)
        async with session.post(f"{gateway_url}/v1/completions",
                                json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1}) as resp:
            assert resp.status == 200, await resp.text()
        query = {"model": "tiny", "block_size": PAGE_TOKENS, "token_ids": PROMPT}

        async def answer(gpu: int) -> dict[str, int]:
            async with session.post(f"{gateway_url}/query", json=query) as resp:
                body = await resp.json()
            got = body["default"]["A"]
            assert (got["GPU"], got["CPU"]) == (gpu, FULL), got
            return dict(got)

        both = await eventually(lambda: answer(FULL), "the prompt on the GPU and the host",
                                15, 0.05)
        assert both["longest_matched"] == FULL and both["DP"] == {"0": FULL}

        async def flushed() -> bool:
            async with session.post(engine_url + "/flush_cache") as resp:
                assert resp.status == 200, await resp.text()
                return True

        await eventually(flushed, "the engine's GPU flushed", 15, 0.1)
        host_only = await eventually(lambda: answer(0), "the prompt on the host only", 15, 0.05)
        assert host_only["longest_matched"] == FULL and host_only["DP"] == {"0": FULL}
