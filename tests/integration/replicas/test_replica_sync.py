"""Gateway replicas that agree over NATS, through real processes: a nats-server (JetStream
on), simulated engines with their sidecars, and two ``kvsidecar gateway --nats``."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import aiohttp
import pytest

from kvsidecar.launch import ManagedProcess
from kvsidecar.local_stack import EngineSpec, GatewaySpec, LocalStack, StackSpec
from tests.support.gateway import routable
from tests.support.polling import eventually
from tests.support.stacks import gateway_process, own_gateways

pytestmark = pytest.mark.slow

WORDS = ["cache", "token", "prefix", "block", "engine", "gateway", "replica", "memory"]
PEER_TIMEOUT_S = "1"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """NATS and two simulated engines with sidecars, shared by the module's gateways. A
    prompt's prefill takes seconds (2 ms a token), so it is still running while a second
    gateway places the same prefix: only the first gateway's message can tell it where."""
    spec = StackSpec(engines=(EngineSpec(replicas=2, args=("--sim-prefill-us-per-token",
                                                           "2000")),),
                     gateways=(), nats=True)
    with LocalStack(spec, tmp_path_factory.mktemp("replicas")) as stack:
        yield stack


@pytest.fixture
def gateways(fleet: LocalStack) -> Iterator[list[ManagedProcess]]:
    yield from _gateway_pair(fleet)


@pytest.fixture
def wide_window_gateways(fleet: LocalStack) -> Iterator[list[ManagedProcess]]:
    """Two replicas whose new-prompt window (2 s) outlasts any scheduling delay here."""
    yield from _gateway_pair(fleet, "--nats-new-prompt-window-ms", "2000")


def _gateway_pair(fleet: LocalStack, *common: str) -> Iterator[list[ManagedProcess]]:
    with own_gateways(fleet):
        yield [gateway_process(fleet, name, "--nats-peer-timeout-s", PEER_TIMEOUT_S, *common)
               for name in ("gateway-a", "gateway-b")]


def text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] + str((seed + i) % 97)
                    for i in range(words))


def body(system: str, max_tokens: int, stream: bool) -> dict[str, object]:
    return {"model": "tiny", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "hello"}]}


async def metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        page = await resp.text()
    found = re.search(rf"^{name} (\S+)$", page, re.MULTILINE)
    assert found is not None, f"{name} is not in {url}/metrics"
    return float(found.group(1))


async def reaches(session: aiohttp.ClientSession, url: str, name: str, value: float) -> None:
    async def check() -> bool:
        seen = await metric(session, url, name)
        assert seen == value, f"{name} is {seen}, waiting for {value}"
        return True

    await eventually(check, f"{name} == {value} at {url}", timeout_s=20)


@asynccontextmanager
async def streaming(session: aiohttp.ClientSession, url: str, system: str) -> AsyncIterator[str]:
    """A long stream held open through ``url``; yields the worker it was placed on."""
    async with session.post(f"{url}/v1/chat/completions",
                            json=body(system, 4000, stream=True)) as resp:
        assert resp.status == 200
        yield resp.headers["x-kvsidecar-worker"]


async def chat(session: aiohttp.ClientSession, url: str, system: str) -> tuple[str, int]:
    """(the worker, the blocks the gateway predicted cached there)."""
    async with session.post(f"{url}/v1/chat/completions", json=body(system, 2, False)) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-kvsidecar-worker"], int(resp.headers["x-kvsidecar-cached-blocks"])


async def test_peer_placement_shows_up_and_draws_the_same_prefix(
    gateways: list[ManagedProcess], session: aiohttp.ClientSession
) -> None:
    """A request placed through A counts in B's load at once, and B, while the prefix is
    still being prefilled (no stored event yet), predicts it cached on A's worker and sends
    the same prefix there."""
    a, b = gateways
    await routable(session, a.url, 2)
    await routable(session, b.url, 2)
    await reaches(session, b.url, "kvsidecar_gateway_replica_peers", 1)
    for seed in range(3):
        system = text(seed, 300)
        through_a = asyncio.create_task(chat(session, a.url, system))
        await reaches(session, b.url, "kvsidecar_gateway_replica_remote_requests", 1)
        worker_b, predicted_b = await chat(session, b.url, system)
        worker_a, _ = await through_a  # (placed at once, or where B claimed it for A)
        assert worker_b == worker_a
        assert predicted_b > 0  # only A's message could have told B
        await reaches(session, b.url, "kvsidecar_gateway_replica_remote_requests", 0)
    # each new prefix through A was placed with the other's share of the workers weighed, by
    # A or (A holding it for its owner) by B
    spread = "kvsidecar_gateway_replica_new_prefix_spread_total"
    assert await metric(session, a.url, spread) + await metric(session, b.url, spread) >= 3


async def test_a_new_prompt_through_both_replicas_at_once_takes_one_worker(
    wide_window_gateways: list[ManagedProcess], session: aiohttp.ClientSession
) -> None:
    """A new prompt sent first through the replica that does not own it waits there; sent
    then through its owner, it is placed there at once, and the first replica, hearing
    that, sends its session to the same worker: one copy, as through one gateway. (Prompts
    that the first replica owns are placed at once and skipped.)"""
    a, b = wide_window_gateways
    for gw, other in ((a, b), (b, a)):
        await routable(session, gw.url, 2)
        await reaches(session, other.url, "kvsidecar_gateway_replica_peers", 1)
    held_metric = "kvsidecar_gateway_replica_new_prompts_held_total"
    followed_metric = "kvsidecar_gateway_replica_new_prompts_held_followed_total"
    merged = 0
    for seed in range(40, 60):
        system = text(seed, 300)
        held_before = await metric(session, a.url, held_metric)
        through_a = asyncio.create_task(chat(session, a.url, system))

        async def held_or_placed(held_before: float = held_before,
                                 through_a: asyncio.Task[tuple[str, int]] = through_a
                                 ) -> str | None:
            if await metric(session, a.url, held_metric) > held_before:
                return "held"
            remote = await metric(session, b.url, "kvsidecar_gateway_replica_remote_requests")
            return "placed" if remote > 0 or through_a.done() else None

        if await eventually(held_or_placed, "A holds the prompt or places it") == "placed":
            await through_a  # A owns this prompt: nothing to merge
            await reaches(session, b.url, "kvsidecar_gateway_replica_remote_requests", 0)
            continue
        followed_before = await metric(session, a.url, followed_metric)
        worker_b, predicted_b = await chat(session, b.url, system)
        worker_a, predicted_a = await through_a
        assert (worker_a, predicted_b) == (worker_b, 0)
        assert predicted_a > 0  # placed where B's placement predicted the prompt
        assert await metric(session, a.url, followed_metric) == followed_before + 1
        await reaches(session, b.url, "kvsidecar_gateway_replica_remote_requests", 0)
        merged += 1
        if merged == 2:
            break
    assert merged == 2, "20 new prompts and fewer than 2 owned by B: the owners are skewed"


async def test_a_held_prompt_whose_owner_has_no_session_of_it_is_placed_by_the_owner(
    gateways: list[ManagedProcess], session: aiohttp.ClientSession
) -> None:
    """A new prompt that only the replica not owning it receives waits its window, then
    that replica asks the owner, which chooses the worker (a claim); the request goes
    there, and the owner's own session of the prompt, later, follows its claim."""
    a, b = gateways
    for gw, other in ((a, b), (b, a)):
        await routable(session, gw.url, 2)
        await reaches(session, other.url, "kvsidecar_gateway_replica_peers", 1)
    prefix = "kvsidecar_gateway_replica_new_prompts"
    for seed in range(60, 80):
        system = text(seed, 300)
        held = await metric(session, a.url, f"{prefix}_held_total")
        claimed = await metric(session, a.url, f"{prefix}_held_claimed_total")
        claims = await metric(session, b.url, f"{prefix}_claimed_total")
        worker_a, _ = await chat(session, a.url, system)
        if await metric(session, a.url, f"{prefix}_held_total") == held:
            continue  # A owns this prompt: placed at once
        assert await metric(session, a.url, f"{prefix}_held_claimed_total") == claimed + 1
        assert await metric(session, b.url, f"{prefix}_claimed_total") == claims + 1
        worker_b, predicted_b = await chat(session, b.url, system)
        assert (worker_b, predicted_b > 0) == (worker_a, True)
        return
    raise AssertionError("20 new prompts and none owned by B: the owners are skewed")


async def test_killed_gateway_leaves_no_load(
    gateways: list[ManagedProcess], session: aiohttp.ClientSession
) -> None:
    """A gateway killed with requests in flight has its load dropped by the other."""
    a, b = gateways
    await routable(session, a.url, 2)
    await reaches(session, b.url, "kvsidecar_gateway_replica_peers", 1)
    async with streaming(session, a.url, text(11, 50)):
        await reaches(session, b.url, "kvsidecar_gateway_replica_remote_requests", 1)
        a.kill()
    await reaches(session, b.url, "kvsidecar_gateway_replica_remote_requests", 0)
    await reaches(session, b.url, "kvsidecar_gateway_replica_peers", 0)
    assert await metric(session, b.url, "kvsidecar_gateway_replica_peers_lost_total") == 1


async def test_nats_down_both_keep_serving(
    fleet: LocalStack, gateways: list[ManagedProcess], session: aiohttp.ClientSession
) -> None:
    """NATS killed mid-run: both replicas keep serving alone, count it, and reconnect."""
    a, b = gateways
    for gw in gateways:
        await routable(session, gw.url, 2)
        await reaches(session, gw.url, "kvsidecar_gateway_replica_peers", 1)
    nats = fleet.nats
    assert nats is not None
    nats.kill()
    for gw in gateways:
        await reaches(session, gw.url, "kvsidecar_gateway_replica_nats_connected", 0)
    for seed in range(4):
        for gw in gateways:
            await chat(session, gw.url, text(20 + seed, 20))
    assert await metric(session, a.url, "kvsidecar_gateway_replica_nats_disconnects_total") == 1
    assert await metric(session, a.url, "kvsidecar_gateway_replica_events_dropped_total") > 0
    nats.start()  # on the same port
    for gw in gateways:
        await reaches(session, gw.url, "kvsidecar_gateway_replica_nats_connected", 1)
        await reaches(session, gw.url, "kvsidecar_gateway_replica_peers", 1)
    async with streaming(session, a.url, text(30, 50)):
        await reaches(session, b.url, "kvsidecar_gateway_replica_remote_requests", 1)


async def test_unreachable_nats_at_start_and_no_nats(
    fleet: LocalStack, session: aiohttp.ClientSession
) -> None:
    """A gateway whose NATS never answers serves alone; one without --nats has no link."""
    with own_gateways(fleet):
        started = []
        for name, joins, extra in (("alone", False, ()),
                                   ("unreachable", True, ("--nats", "nats://127.0.0.1:9"))):
            gw = fleet.add_gateway(GatewaySpec(name=name, nats=joins, wait_routable=False,
                                               args=extra))[0]
            started.append(gw)
            await routable(session, gw.url, 2)
            await chat(session, gw.url, text(40, 20))
        alone, unreachable = started
        async with session.get(f"{alone.url}/metrics") as resp:
            assert "replica_" not in await resp.text()
        assert await metric(session, unreachable.url,
                            "kvsidecar_gateway_replica_nats_connected") == 0
        assert await metric(session, unreachable.url,
                            "kvsidecar_gateway_replica_nats_errors_total") >= 1
