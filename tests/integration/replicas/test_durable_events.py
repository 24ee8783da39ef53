"""Durable KV events over NATS JetStream, through real processes: a nats-server (JetStream
on), simulated engines with sidecars given ``--events-via nats``, and gateways reading the
events from JetStream, restarting warm from an index snapshot."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import aiohttp
import pytest

from kvcore import nats_extra
from kvcore.jetstream import events_subject
from kvsidecar.launch import ManagedProcess
from kvsidecar.local_nats import NatsServer
from kvsidecar.local_stack import EngineSpec, LocalStack, StackSpec
from tests.support.gateway import routable
from tests.support.polling import eventually
from tests.support.stacks import gateway_process, own_gateways

pytestmark = pytest.mark.slow

WORKERS = ("replica-0", "replica-1")
WORDS = ["cache", "token", "prefix", "block", "engine", "gateway", "replica", "memory"]


def text(seed: int, words: int = 200) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] + str((seed + i) % 97)
                    for i in range(words))


async def chat(session: aiohttp.ClientSession, url: str, system: str) -> tuple[str, int]:
    """(the worker, the blocks the gateway predicted cached there)."""
    body = {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "hello"}]}
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-kvsidecar-worker"], int(resp.headers["x-kvsidecar-cached-blocks"])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """NATS, and two simulated engines whose sidecars publish to JetStream."""
    spec = StackSpec(engines=(EngineSpec(replicas=2, worker_ids=WORKERS),), gateways=(),
                     nats=True, nats_events=True)
    with LocalStack(spec, tmp_path_factory.mktemp("durable")) as stack:
        yield stack


@pytest.fixture
def start_gateway(fleet: LocalStack) -> Iterator[Callable[[str], ManagedProcess]]:
    """Starts gateways reading the events from JetStream; stops them after the test."""
    with own_gateways(fleet):
        yield lambda name: gateway_process(fleet, name, "--events-via", "nats",
                                        "--snapshot-interval-s", "0.5")


def sidecar_urls(fleet: LocalStack) -> list[str]:
    return [fleet.sidecar_urls[w] for w in WORKERS]


def nats_of(fleet: LocalStack) -> NatsServer:
    assert fleet.nats is not None
    return fleet.nats


async def metric(session: aiohttp.ClientSession, url: str, series: str) -> float:
    """One series of ``url``'s /metrics, labels included (``name{worker="w"}``)."""
    async with session.get(f"{url}/metrics") as resp:
        page = await resp.text()
    found = re.search(rf"^{re.escape(series)} (\S+)$", page, re.MULTILINE)
    assert found is not None, f"{series} is not in {url}/metrics"
    return float(found.group(1))


async def reaches(session: aiohttp.ClientSession, url: str, series: str,
                  done: Callable[[float], bool], what: str) -> float:
    async def check() -> bool:
        value = await metric(session, url, series)
        assert done(value), f"{series} is {value}, waiting for {what}"
        return True

    await eventually(check, f"{series} {what} at {url}", timeout_s=30)
    return await metric(session, url, series)


async def cached_on_repeat(session: aiohttp.ClientSession, url: str,
                           system: str) -> tuple[str, int]:
    """Once the first request's blocks are indexed, where a repeat goes and what it hits."""
    async def placed() -> tuple[str, int]:
        worker, cached = await chat(session, url, system)
        assert cached > 0, f"{system[:20]}... not cached anywhere yet"
        return worker, cached

    return await eventually(placed, "the prefix in the gateway's index", timeout_s=30)


async def live(session: aiohttp.ClientSession, url: str) -> None:
    await routable(session, url, len(WORKERS))
    await reaches(session, url, "kvsidecar_gateway_durable_live", lambda v: v == 1, "== 1")


async def test_events_flow_through_jetstream(
    fleet: LocalStack, start_gateway: Callable[[str], ManagedProcess],
    session: aiohttp.ClientSession,
) -> None:
    """The gateway's index fills from JetStream: its sidecar streams carry status only."""
    gw = start_gateway("gateway")
    await live(session, gw.url)
    for sidecar, worker in zip(sidecar_urls(fleet), WORKERS, strict=True):
        series = f'kvsidecar_event_subscribers_status_only{{worker="{worker}"}}'
        assert await metric(session, sidecar, series) == 1
        assert await metric(session, sidecar, "kvsidecar_jetstream_connected") == 1
    first, _ = await chat(session, gw.url, text(1))
    worker, cached = await cached_on_repeat(session, gw.url, text(1))
    assert worker == first and cached > 0
    assert await metric(session, gw.url, "kvsidecar_gateway_durable_events_applied_total") > 0


async def test_restarted_gateway_starts_from_the_snapshot(
    fleet: LocalStack, start_gateway: Callable[[str], ManagedProcess],
    session: aiohttp.ClientSession,
) -> None:
    """A gateway started after another one died loads its snapshot, replays the stream after
    it, resumes the sidecar streams without a snapshot of theirs, and places known prefixes
    where they are cached."""
    a = start_gateway("gateway-a")
    await live(session, a.url)
    placed = {}
    for seed in (10, 11, 12):
        first, _ = await chat(session, a.url, text(seed))
        placed[seed] = (await cached_on_repeat(session, a.url, text(seed)))[0]
        assert placed[seed] == first
    # A snapshot covering every event of the requests (one may have been written already:
    # the next is written only when more events arrive)
    applied = await metric(session, a.url, "kvsidecar_gateway_durable_stream_seq")
    await reaches(session, a.url, "kvsidecar_gateway_durable_snapshot_stream_seq",
                  lambda v: v >= applied, "a snapshot after the requests")
    first, _ = await chat(session, a.url, text(13))  # after the snapshot: replayed
    placed[13] = (await cached_on_repeat(session, a.url, text(13)))[0]
    assert placed[13] == first
    a.kill()
    snapshots_before = [
        await metric(session, url, f'kvsidecar_stream_snapshots_total{{worker="{w}"}}')
        for url, w in zip(sidecar_urls(fleet), WORKERS, strict=True)]
    b = start_gateway("gateway-b")
    await live(session, b.url)
    assert await metric(session, b.url, "kvsidecar_gateway_durable_snapshot_loaded_blocks") > 0
    assert await metric(session, b.url, "kvsidecar_gateway_durable_warm_start_seconds") > 0
    snapshots_after = [
        await metric(session, url, f'kvsidecar_stream_snapshots_total{{worker="{w}"}}')
        for url, w in zip(sidecar_urls(fleet), WORKERS, strict=True)]
    assert snapshots_after == snapshots_before  # resumed from positions, not resynced
    for seed, worker in placed.items():
        assert (await chat(session, b.url, text(seed)))[0] == worker
        assert (await chat(session, b.url, text(seed)))[1] > 0


async def test_nats_down_falls_back_to_the_sidecar_streams(
    fleet: LocalStack, start_gateway: Callable[[str], ManagedProcess],
    session: aiohttp.ClientSession,
) -> None:
    """NATS killed: sidecars count the frames they could not publish and send them on their
    streams, the gateway loses no request and keeps its index current; NATS back, the
    events come from JetStream again."""
    gw = start_gateway("gateway")
    await live(session, gw.url)
    nats_of(fleet).kill()
    await reaches(session, gw.url, "kvsidecar_gateway_durable_live", lambda v: v == 0, "== 0")
    for sidecar in sidecar_urls(fleet):
        await reaches(session, sidecar, "kvsidecar_jetstream_connected", lambda v: v == 0, "0")
    first, _ = await chat(session, gw.url, text(20))
    worker, cached = await cached_on_repeat(session, gw.url, text(20))
    assert worker == first and cached > 0
    dropped = sum([await metric(session, url, "kvsidecar_jetstream_frames_dropped_total")
                   for url in sidecar_urls(fleet)])
    assert dropped > 0
    nats_of(fleet).start()  # on the same port, with its store
    await live(session, gw.url)
    for sidecar in sidecar_urls(fleet):
        await reaches(session, sidecar, "kvsidecar_jetstream_connected", lambda v: v == 1, "1")
    first, _ = await chat(session, gw.url, text(21))
    worker, cached = await cached_on_repeat(session, gw.url, text(21))
    assert worker == first and cached > 0


async def test_corrupt_message_is_counted_and_skipped(
    fleet: LocalStack, start_gateway: Callable[[str], ManagedProcess],
    session: aiohttp.ClientSession,
) -> None:
    """Bytes that are no batch of frames, on a worker's subject: logged, counted, skipped;
    the events after it still apply."""
    gw = start_gateway("gateway")
    await live(session, gw.url)
    nc = await nats_extra.load("this test").connect(nats_of(fleet).url)
    try:
        await nc.jetstream().publish(events_subject("tiny", WORKERS[0]), b"\x00\x00\x00\x09oops")
    finally:
        await nc.close()
    await reaches(session, gw.url, "kvsidecar_gateway_durable_messages_rejected_total",
                  lambda v: v == 1, "== 1")
    first, _ = await chat(session, gw.url, text(30))
    worker, cached = await cached_on_repeat(session, gw.url, text(30))
    assert worker == first and cached > 0
    assert await metric(session, gw.url, "kvsidecar_gateway_durable_live") == 1
