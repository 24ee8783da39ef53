"""Durable KV events over NATS JetStream, through real processes: a nats-server (JetStream
on), simulated engines with sidecars given ``--events-via nats``, and gateways reading the
events from JetStream, restarting warm from an index snapshot."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from kvcore import nats_extra
from kvcore.jetstream import events_subject
from kvsidecar.launch import ManagedProcess
from kvsidecar.local_nats import NatsServer
from tests.support.gateway import routable
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "refengine" / "models" / "tiny"
EVENTS = json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                     "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"})
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


@dataclass
class Fleet:
    nats: NatsServer
    sidecar_urls: list[str]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """NATS, and two simulated engines whose sidecars publish to JetStream."""
    tmp = tmp_path_factory.mktemp("durable")
    procs: list[ManagedProcess] = []
    nats = NatsServer(tmp).start()
    try:
        engines = ManagedProcess.start(
            "engines",
            ["refengine", "--compute", "sim", "--replicas", "2", "--port", "0",
             "--kv-events-config", EVENTS],
            workdir=tmp,
        )
        procs.append(engines)
        urls = [r["url"] for r in engines.wait_ready(60, count=2)]
        for worker, url in zip(WORKERS, urls, strict=True):
            procs.append(ManagedProcess.start(
                f"sidecar-{worker}",
                ["sidecar", "--engine-url", url, "--worker-id", worker, "--port", "0",
                 "--events-via", "nats", "--nats", nats.url],
                workdir=tmp,
            ))
        for sc in procs[1:]:
            sc.wait_ready(60)
        yield Fleet(nats, [sc.url for sc in procs[1:]])
    finally:
        for proc in reversed(procs):
            proc.stop()
        nats.stop()


@pytest.fixture
def start_gateway(fleet: Fleet, tmp_path: Path) -> Iterator[Callable[[str], ManagedProcess]]:
    """Starts gateways reading the events from JetStream; stops them after the test."""
    started: list[ManagedProcess] = []

    def start(name: str) -> ManagedProcess:
        flags = [f for url in fleet.sidecar_urls for f in ("--sidecar", url)]
        gw = ManagedProcess.start(
            name,
            ["routing", "--port", "0", "--model-path", str(MODEL), "--seed", "1",
             "--health-check-interval-s", "0.5", "--nats", fleet.nats.url,
             "--events-via", "nats", "--snapshot-interval-s", "0.5", *flags],
            workdir=tmp_path,
        )
        started.append(gw)
        gw.wait_ready(60)
        return gw

    yield start
    for gw in reversed(started):
        gw.stop()


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
    fleet: Fleet, start_gateway: Callable[[str], ManagedProcess],
    session: aiohttp.ClientSession,
) -> None:
    """The gateway's index fills from JetStream: its sidecar streams carry status only."""
    gw = start_gateway("gateway")
    await live(session, gw.url)
    for sidecar, worker in zip(fleet.sidecar_urls, WORKERS, strict=True):
        series = f'kvsidecar_event_subscribers_status_only{{worker="{worker}"}}'
        assert await metric(session, sidecar, series) == 1
        assert await metric(session, sidecar, "kvsidecar_jetstream_connected") == 1
    first, _ = await chat(session, gw.url, text(1))
    worker, cached = await cached_on_repeat(session, gw.url, text(1))
    assert worker == first and cached > 0
    assert await metric(session, gw.url, "kvsidecar_gateway_durable_events_applied_total") > 0


async def test_restarted_gateway_starts_from_the_snapshot(
    fleet: Fleet, start_gateway: Callable[[str], ManagedProcess],
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
    written = await metric(session, a.url, "kvsidecar_gateway_durable_snapshots_written_total")
    await reaches(session, a.url, "kvsidecar_gateway_durable_snapshots_written_total",
                  lambda v: v > written, "a snapshot after the requests")
    first, _ = await chat(session, a.url, text(13))  # after the snapshot: replayed
    placed[13] = (await cached_on_repeat(session, a.url, text(13)))[0]
    assert placed[13] == first
    a.kill()
    snapshots_before = [
        await metric(session, url, f'kvsidecar_stream_snapshots_total{{worker="{w}"}}')
        for url, w in zip(fleet.sidecar_urls, WORKERS, strict=True)]
    b = start_gateway("gateway-b")
    await live(session, b.url)
    assert await metric(session, b.url, "kvsidecar_gateway_durable_snapshot_loaded_blocks") > 0
    assert await metric(session, b.url, "kvsidecar_gateway_durable_warm_start_seconds") > 0
    snapshots_after = [
        await metric(session, url, f'kvsidecar_stream_snapshots_total{{worker="{w}"}}')
        for url, w in zip(fleet.sidecar_urls, WORKERS, strict=True)]
    assert snapshots_after == snapshots_before  # resumed from positions, not resynced
    for seed, worker in placed.items():
        assert (await chat(session, b.url, text(seed)))[0] == worker
        assert (await chat(session, b.url, text(seed)))[1] > 0


async def test_nats_down_falls_back_to_the_sidecar_streams(
    fleet: Fleet, start_gateway: Callable[[str], ManagedProcess],
    session: aiohttp.ClientSession,
) -> None:
    """NATS killed: sidecars count the frames they could not publish and send them on their
    streams, the gateway loses no request and keeps its index current; NATS back, the
    events come from JetStream again."""
    gw = start_gateway("gateway")
    await live(session, gw.url)
    fleet.nats.kill()
    await reaches(session, gw.url, "kvsidecar_gateway_durable_live", lambda v: v == 0, "== 0")
    for sidecar in fleet.sidecar_urls:
        await reaches(session, sidecar, "kvsidecar_jetstream_connected", lambda v: v == 0, "0")
    first, _ = await chat(session, gw.url, text(20))
    worker, cached = await cached_on_repeat(session, gw.url, text(20))
    assert worker == first and cached > 0
    dropped = sum([await metric(session, url, "kvsidecar_jetstream_frames_dropped_total")
                   for url in fleet.sidecar_urls])
    assert dropped > 0
    fleet.nats.start()  # on the same port, with its store
    await live(session, gw.url)
    for sidecar in fleet.sidecar_urls:
        await reaches(session, sidecar, "kvsidecar_jetstream_connected", lambda v: v == 1, "1")
    first, _ = await chat(session, gw.url, text(21))
    worker, cached = await cached_on_repeat(session, gw.url, text(21))
    assert worker == first and cached > 0


async def test_corrupt_message_is_counted_and_skipped(
    fleet: Fleet, start_gateway: Callable[[str], ManagedProcess],
    session: aiohttp.ClientSession,
) -> None:
    """Bytes that are no batch of frames, on a worker's subject: logged, counted, skipped;
    the events after it still apply."""
    gw = start_gateway("gateway")
    await live(session, gw.url)
    nc = await nats_extra.load("this test").connect(fleet.nats.url)
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
