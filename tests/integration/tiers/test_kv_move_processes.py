"""A hot prefix moves to a light worker instead of herding, through real processes.

Reference engines with torch compute (real KV bytes) whose HiCache hooks write through to
their own sidecar's store (the replicas ``conftest.py`` shares with the tier-credit test); a
gateway over the two sidecars A and B, its weights fixed, its health probes out of the way;
a plain engine C computes what a full prefill answers.

A holds a 12-page prompt. A request sharing it goes to A; while it is held there (A's engine
stopped, or A's sidecar), A's queue outweighs the cached prefix, and the next one is placed
on B with the reason ``moved``: B's sidecar pulls the pages from A's store before prefill.
With A's engine stopped, A's sidecar exports them, B's engine reports them cached, and the
reply equals C's; with A's sidecar stopped the pull times out, B recomputes, and the reply
is the same, with nothing cached.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvsidecar.launch import ManagedProcess
from kvsidecar.local_stack import GatewaySpec, LocalStack
from shm import BlockStoreClient
from tests.integration.disagg.pd_stack import metric
from tests.support.gateway import routable
from tests.support.polling import eventually
from tests.support.stacks import own_gateways
from tests.support.tier_stack import PAGE_TOKENS, generate, hook_attached

pytestmark = pytest.mark.slow

PAGES = 12


@dataclass
class Stack:
    engines: dict[str, ManagedProcess]
    sidecars: dict[str, ManagedProcess]
    socks: dict[str, Path]
    gateway: str


@pytest.fixture(scope="module")
def stack(replicas: LocalStack) -> Iterator[Stack]:
    """The shared replicas (conftest.py) behind a gateway over A and B."""
    with own_gateways(replicas):
        # Fixed weights: the placements below follow from the loads, not from a fit. No
        # periodic probe: a stopped sidecar stays a worker (and a source) for the test.
        gateway = replicas.add_gateway(GatewaySpec(
            only=("A", "B"), health_check_interval_s=3600, wait_routable=False,
            args=("--overlap-weight", "1", "--prefill-load-scale", "1", "--kv-move", "on")))
        sidecars = {p.worker_id: p.proc for p in replicas.sidecars
                    if isinstance(p.proc, ManagedProcess)}
        yield Stack({n: replicas.process(n) for n in ("A", "B", "C")}, sidecars,
                    replicas.store_sockets, gateway[0].url)


def prompt(seed: int, suffix: int = 0) -> list[int]:
    """12 pages of a shared prefix (by ``seed``), then 67 tokens of the request's own."""
    head = [(i * seed + 11) % 900 + 5 for i in range(PAGES * PAGE_TOKENS)]
    return head + [(i * 7 + suffix * 131) % 900 + 5 for i in range(4 * PAGE_TOKENS + 3)]


async def complete(session: aiohttp.ClientSession, url: str,
                   ids: list[int]) -> tuple[dict[str, Any], dict[str, str]]:
    body = {"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json(), dict(resp.headers)


def texts(body: dict[str, Any]) -> list[str]:
    return [choice["text"] for choice in body["choices"]]


async def workers(session: aiohttp.ClientSession, gateway: str) -> dict[str, dict[str, Any]]:
    async with session.get(f"{gateway}/v1/workers") as resp:
        return {w["worker_id"]: w for w in (await resp.json())["workers"]}


async def held_on_a(session: aiohttp.ClientSession, s: Stack, seed: int) -> None:
    """A computes the prefix (its hook writes it through to its store); the gateway sees it
    in A's GPU and host tiers, and B's store holding something (it can pull)."""
    before = (await workers(session, s.gateway))["A"]["cached_blocks"]["host"]
    assert await generate(session, s.engines["A"].url, prompt(seed)) == {}

    async def indexed() -> bool:
        seen = await workers(session, s.gateway)
        a, b = seen["A"]["cached_blocks"], seen["B"]["cached_blocks"]
        assert a["host"] >= before + PAGES + 4 and a["gpu"] >= PAGES and b["host"] > 0, seen
        return True

    await eventually(indexed, "the prefix in A's tiers, B's store known")


async def held_there(session: aiohttp.ClientSession, s: Stack, ids: list[int]) -> asyncio.Task[Any]:
    """Send ``ids`` through the gateway (to A, the holder) and wait until it is in flight
    there; the task answers once A runs again."""
    task = asyncio.create_task(complete(session, s.gateway, ids))

    async def in_flight() -> bool:
        assert (await workers(session, s.gateway))["A"]["in_flight"] == 1
        return True

    await eventually(in_flight, "the first request in flight on A")
    return task


@pytest.fixture(scope="module")
def ready(stack: Stack) -> Stack:
    async def attach() -> None:
        async with aiohttp.ClientSession() as session:
            await routable(session, stack.gateway, 2)
            for n in ("A", "B"):
                with BlockStoreClient(str(stack.socks[n])) as store:
                    await hook_attached(session, stack.engines[n].url, store)

    asyncio.run(attach())
    return stack


async def test_a_hot_prefix_moves_to_the_light_worker(
        ready: Stack, session: aiohttp.ClientSession) -> None:
    """A's engine is stopped with a request of the prefix queued: the next is moved to B,
    whose sidecar pulls the 12 pages from A's store; B's engine reports them cached, and
    the reply is what a full prefill answers."""
    s = ready
    await held_on_a(session, s, 37)
    expected = texts((await complete(session, s.engines["C"].url, prompt(37, 2)))[0])
    with s.engines["A"].paused():
        first = await held_there(session, s, prompt(37, 1))
        body, headers = await complete(session, s.gateway, prompt(37, 2))
    assert (headers["x-kvsidecar-worker"], headers["x-kvsidecar-placement-reason"],
            headers["x-kvsidecar-cached-blocks"]) == ("B", "moved", str(PAGES))
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == PAGES * PAGE_TOKENS
    assert texts(body) == expected
    _, first_headers = await first
    assert first_headers["x-kvsidecar-worker"] == "A"
    b_sidecar = s.sidecars["B"].url
    assert await metric(session, b_sidecar, 'kvsidecar_kv_moves_total{outcome="ok"}') == 1
    assert await metric(session, s.gateway,
                        'kvsidecar_gateway_kv_moves_total{outcome="ok"}') == 1


async def test_a_failed_pull_is_a_recompute(
        ready: Stack, session: aiohttp.ClientSession) -> None:
    """A's sidecar is stopped: B's pull from it times out, and B's engine prefills the whole
    prompt; the client gets the same reply, with nothing cached, and no error."""
    s = ready
    await held_on_a(session, s, 53)
    expected = texts((await complete(session, s.engines["C"].url, prompt(53, 2)))[0])
    with s.sidecars["A"].paused():
        first = await held_there(session, s, prompt(53, 1))
        body, headers = await complete(session, s.gateway, prompt(53, 2))
    assert (headers["x-kvsidecar-worker"], headers["x-kvsidecar-placement-reason"]) == (
        "B", "moved")
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert texts(body) == expected
    _, first_headers = await first
    assert first_headers["x-kvsidecar-worker"] == "A"
    timeout = '{outcome="transfer_timeout"}'
    assert await metric(session, s.sidecars["B"].url, "kvsidecar_kv_moves_total" + timeout) == 1
    assert await metric(session, s.gateway, "kvsidecar_gateway_kv_moves_total" + timeout) == 1
