"""The gateway credits blocks held below the GPU, through real processes: reference engines
with torch compute whose HiCache hooks key pages by their SGLang page hashes, sidecars with
their default store layout, one ``redis-server``. A prompt held only in a sidecar's host
memory, or only in the remote store, is predicted there at its full length and placed
there, and the engine there loads it and answers as an engine that computed it does.

Replica A (``--remote-tier-write evict``: what it computes stays in its host memory) and a
plain engine C serve behind the gateway; a writer replica W, which the gateway does not
know, puts prompts in the remote store. The processes are the replicas ``conftest.py``
shares with the kv-move test: W is its B."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from kvsidecar.local_stack import GatewaySpec, LocalStack
from shm import BlockStoreClient
from tests.support.gateway import routable
from tests.support.polling import eventually, wait_until
from tests.support.stacks import own_gateways
from tests.support.tier_stack import PAGE_TOKENS, generate, hook_attached

pytestmark = pytest.mark.slow

PAGES = 12


def prompt(seed: int) -> list[int]:
    # Its first page is none of the kv-move test's (the replicas are shared): no page of it
    # is cached anywhere before this test computes it, whichever module ran first.
    return [(i * seed + 17) % 1000 + 5 for i in range(PAGES * PAGE_TOKENS + 5)]


async def complete(session: aiohttp.ClientSession, url: str,
                   ids: list[int]) -> tuple[dict[str, Any], dict[str, str]]:
    """A greedy completion of ``ids``: the body, and the gateway's placement headers."""
    body = {"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json(), dict(resp.headers)


async def flushed(session: aiohttp.ClientSession, engine_url: str) -> bool:
    """Whether the engine dropped its cached pages (it refuses while a request runs: the
    gateway's and the sidecar's probes send some)."""
    async with session.post(engine_url + "/flush_cache") as resp:
        assert resp.status == 200, await resp.text()
        return True


def texts(body: dict[str, Any]) -> list[str]:
    return [choice["text"] for choice in body["choices"]]


async def cached_at(session: aiohttp.ClientSession, gateway: str, worker: str) -> dict[str, int]:
    """The blocks the gateway's index holds for ``worker``, per tier."""
    async with session.get(f"{gateway}/v1/workers") as resp:
        workers = (await resp.json())["workers"]
    return next(w["cached_blocks"] for w in workers if w["worker_id"] == worker)


async def test_prompts_held_only_below_the_gpu_are_credited_and_placed_there(
        replicas: LocalStack, session: aiohttp.ClientSession) -> None:
    """Only in A's host memory (its GPU copy flushed), then only in the remote store (W put
    it there): the gateway predicts all 12 blocks on A, places the prompt on A over an empty
    engine, and A loads the 12 pages and answers as the engine that computed them."""
    socks = {"A": replicas.store_sockets["A"], "W": replicas.store_sockets["B"]}
    engines = {n: replicas.process(w) for n, w in (("A", "A"), ("W", "B"), ("C", "C"))}
    with own_gateways(replicas):
        gateway = replicas.add_gateway(GatewaySpec(
            only=("A",), health_check_interval_s=0.5, wait_routable=False,
            args=("--worker", engines["C"].url)))[0]
        await routable(session, gateway.url, 2)
        with BlockStoreClient(str(socks["A"])) as store_a, \
                BlockStoreClient(str(socks["W"])) as store_w:
            wait_until(lambda: store_a.stats().remote_connected
                       and store_w.stats().remote_connected, "both remote tiers connected")
            await hook_attached(session, engines["A"].url, store_a)
            await hook_attached(session, engines["W"].url, store_w)
            # C computes both prompts: what a full prefill answers.
            expected = [texts((await complete(session, engines["C"].url, prompt(s)))[0])
                        for s in (37, 53)]

            # Only in A's host memory: A computed it (its hook wrote the pages through to
            # its store), then its GPU copy was flushed.
            async def host_credited() -> int:
                cached, held = await cached_at(session, gateway.url, "A"), store_a.stats()
                assert cached["host"] == held.num_blocks, (cached, held.num_blocks)
                return held.num_blocks

            host_before = await eventually(host_credited, "A's store credited as a whole")
            assert await generate(session, engines["A"].url, prompt(37)) == {}
            await eventually(lambda: flushed(session, engines["A"].url), "A's GPU flushed")

            async def host_only() -> bool:
                cached = await cached_at(session, gateway.url, "A")
                assert cached["gpu"] == 0, cached
                return await host_credited() == host_before + PAGES

            await eventually(host_only, "A's prompt in the gateway's host tier only")
            body, headers = await complete(session, gateway.url, prompt(37))
            assert (headers["x-kvsidecar-worker"], headers["x-kvsidecar-cached-blocks"]) == (
                "A", str(PAGES))
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == PAGES * PAGE_TOKENS
            assert texts(body) == expected[0]

            # Only in the remote store: W computed it and wrote it through; A never saw it.
            writes = store_w.stats().num_remote_writes
            assert await generate(session, engines["W"].url, prompt(53)) == {}
            wait_until(lambda: store_w.stats().num_remote_writes >= writes + PAGES,
                       "W's pages written to the remote store")

            async def remote_indexed() -> bool:
                cached = await cached_at(session, gateway.url, "A")
                held = store_a.stats().num_remote_blocks
                assert cached["remote"] == held >= writes + PAGES, (cached, held)
                return True

            await eventually(remote_indexed, "the remote store's blocks credited on A")
            reads = store_a.stats().num_remote_reads
            body, headers = await complete(session, gateway.url, prompt(53))
            assert (headers["x-kvsidecar-worker"], headers["x-kvsidecar-cached-blocks"]) == (
                "A", str(PAGES))
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == PAGES * PAGE_TOKENS
            assert texts(body) == expected[1]
            assert store_a.stats().num_remote_reads >= reads + PAGES
