"""The sidecar's event stream served over HTTP and consumed by the gateway's feed."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvcore import BlockHasher, namespace_seed
from kvcore.events import BlockRemoved, BlockStored, Tier, WorkerSnapshot
from kvcore.stream import StreamStart, WorkerStatus
from kvcore.wire import FRAME_HEADER, decode
from routing.indexer.rolling_hashes import RollingHashMap, rolling_hashes
from routing.placement.kv_router import KvRouter
from routing.workers.event_feed import SidecarFeed
from sidecar.event_stream import EventStream
from sidecar.relay import EventRelay
from tests.support.polling import eventually

CHAIN = [1000 + i for i in range(64)]


class Sidecar:
    """A real EventStream behind a real HTTP server; the test publishes engine events."""

    def __init__(
        self,
        worker_id: str = "w0",
        queue_frames: int = 8192,
        buffer: int = 4096,
        block_size: int = 16,
    ) -> None:
        self.relay = EventRelay(
            worker_id, block_size=block_size, model_id="m", buffer_events=buffer
        )
        self.stream = EventStream(self.relay, queue_frames=queue_frames)
        self.queries: list[dict[str, str]] = []  # what each subscriber asked
        app = web.Application()
        app.router.add_get("/v1/kv-events", self._handle)
        self.server = TestServer(app, host="127.0.0.1")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.queries.append(dict(request.query))
        return await self.stream.handle(request)

    async def __aenter__(self) -> Sidecar:
        await self.server.start_server()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stream.close()
        await self.server.close()

    @property
    def url(self) -> str:
        return str(self.server.make_url(""))

    def store(self, start: int, end: int, tier: Tier = Tier.GPU) -> None:
        parent = CHAIN[start - 1] if start else None
        self.stream.publish(BlockStored("engine", 0, 0, tier, CHAIN[start:end], parent))

    def evict(self, blocks: list[int]) -> None:
        self.stream.publish(BlockRemoved("engine", 0, 0, Tier.GPU, blocks))


class Heard:
    """A ``FeedListener`` that keeps what the stream said of its worker."""

    def __init__(self) -> None:
        self.up: list[tuple[str, str]] = []
        self.down: list[tuple[str, str | None]] = []
        self.statuses: list[WorkerStatus] = []

    def stream_up(self, worker_id: str, role: str) -> None:
        self.up.append((worker_id, role))

    def stream_down(self, worker_id: str, error: str | None) -> None:
        self.down.append((worker_id, error))

    def reported(self, status: WorkerStatus) -> None:
        self.statuses.append(status)


async def start_feed(
    url: str, session: aiohttp.ClientSession, router: KvRouter | None = None, **kw: object
) -> tuple[SidecarFeed, asyncio.Task[None]]:
    feed = SidecarFeed(url, router or KvRouter(), session, model_id="m", **kw)  # type: ignore[arg-type]
    return feed, asyncio.create_task(feed.run())


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def overlap(feed: SidecarFeed) -> dict[Tier, dict[str, int]]:
    return feed.router.index.match_tiers(CHAIN)


class TestStream:
    async def test_late_subscriber_gets_snapshot_then_live(
        self, session: aiohttp.ClientSession
    ) -> None:
        """A subscriber joining after events gets a snapshot, then live events."""
        async with Sidecar() as sc:
            sc.store(0, 10)
            sc.store(0, 4, Tier.HOST)
            feed, task = await start_feed(sc.url, session)
            await eventually(lambda: overlap(feed) == {Tier.GPU: {"w0": 10}, Tier.HOST: {"w0": 4}},
                             "the snapshot at the feed")
            assert feed.stats.snapshots == 1
            sc.store(10, 20)
            await eventually(lambda: overlap(feed).get(Tier.GPU) == {"w0": 20}, "the live blocks")
            await stop(task)

    async def test_reconnect_converges_like_uninterrupted(
        self, session: aiohttp.ClientSession
    ) -> None:
        """A subscriber that drops and resumes ends where one that stayed connected ends."""
        async with Sidecar() as sc:
            steady, steady_task = await start_feed(sc.url, session)
            flaky, flaky_task = await start_feed(sc.url, session)
            await eventually(lambda: steady.connected and flaky.connected, "both feeds to connect")
            sc.store(0, 8)
            await eventually(lambda: flaky.router.index.position("w0") == (sc.relay.epoch, 1),
                             "the flaky feed at seq 1")
            await stop(flaky_task)
            sc.store(8, 30)
            sc.evict(CHAIN[20:30])
            flaky_task = asyncio.create_task(flaky.run())
            await eventually(lambda: flaky.stats.connects == 2 and flaky.connected,
                             "the flaky feed to reconnect")
            sc.store(20, 25)
            target = {Tier.GPU: {"w0": 25}}
            await eventually(lambda: overlap(steady) == target and overlap(flaky) == target,
                             "both feeds to converge")
            assert flaky.stats.replays == 1  # resumed from the buffer, no snapshot needed
            assert steady.router.index.position("w0") == flaky.router.index.position("w0")
            await stop(steady_task)
            await stop(flaky_task)

    async def test_slow_subscriber_is_dropped_and_resyncs(
        self, session: aiohttp.ClientSession
    ) -> None:
        """Overrunning a subscriber's queue drops only it; it resyncs and converges."""
        async with Sidecar(queue_frames=4, buffer=8) as sc:
            feed, task = await start_feed(sc.url, session)
            await eventually(lambda: feed.connected, "the feed to connect")
            for i in range(40):  # no await between publishes: the queue of 4 overflows
                sc.store(i, i + 1)
            assert sc.stream.subscribers_dropped == 1
            await eventually(lambda: overlap(feed).get(Tier.GPU) == {"w0": 40}, "the resynced feed")
            assert feed.stats.resyncs >= 1 and feed.stats.snapshots >= 2
            await stop(task)

    async def test_sidecar_restart_clears_old_blocks(self, session: aiohttp.ClientSession) -> None:
        """A sidecar that restarts (new epoch, empty cache) replaces what the gateway knew."""
        async with Sidecar() as first:
            first.store(0, 12)
            feed, task = await start_feed(first.url, session)
            await eventually(lambda: overlap(feed).get(Tier.GPU) == {"w0": 12},
                             "the first sidecar's blocks")
        async with Sidecar() as second:
            feed.url = second.url
            second.store(0, 3)
            await eventually(lambda: overlap(feed).get(Tier.GPU) == {"w0": 3},
                             "only the restarted sidecar's blocks")
            await stop(task)

    async def test_dead_sidecar_leaves_the_index_until_it_returns(
        self, session: aiohttp.ClientSession
    ) -> None:
        """Unreachable for dead_after_s, a worker leaves the index; it returns with its sidecar."""
        async with Sidecar() as sc:
            sc.store(0, 6)
            feed, task = await start_feed(sc.url, session, dead_after_s=0.2, retry_s=0.05)
            await eventually(lambda: overlap(feed).get(Tier.GPU) == {"w0": 6}, "the blocks")
        await eventually(lambda: feed.stats.removals == 1, "the dead worker's removal")
        assert overlap(feed) == {}
        async with Sidecar() as back:
            feed.url = back.url
            back.store(0, 2)
            await eventually(lambda: overlap(feed).get(Tier.GPU) == {"w0": 2}, "the worker back")
        await stop(task)

    async def test_block_size_mismatch_is_refused(self, session: aiohttp.ClientSession) -> None:
        """A sidecar with another block size is never applied: overlaps would be silently wrong."""
        async with Sidecar(block_size=32) as sc:
            sc.store(0, 4)
            feed, task = await start_feed(sc.url, session, retry_s=0.05)
            await eventually(lambda: feed.error is not None and "block size 32" in feed.error,
                             "the block size error")
            assert overlap(feed) == {}
            await stop(task)

    async def test_worker_status_reaches_the_listener(self, session: aiohttp.ClientSession) -> None:
        """Statuses reach every subscriber unsequenced; the listener hears up, each status, down."""
        async with Sidecar() as sc:
            heard = Heard()
            feed, task = await start_feed(sc.url, session, listener=heard)
            await eventually(lambda: feed.connected, "the feed to connect")
            assert heard.up == [("w0", "agg")]
            sc.stream.broadcast(WorkerStatus("w0", 1, False, "draining", "agg", 1000))
            await eventually(lambda: bool(heard.statuses), "the status at the listener")
            (status,) = heard.statuses
            assert (status.routable, status.reason, status.capacity_blocks) == (
                False, "draining", 1000)
            await stop(task)
            assert heard.down and heard.down[-1][0] == "w0"

    async def test_bad_position_is_a_clear_error(self, session: aiohttp.ClientSession) -> None:
        """A malformed resume position gets HTTP 400 naming the problem."""
        async with Sidecar() as sc, session.get(f"{sc.url}/v1/kv-events?epoch=x&seq=-1") as resp:
            assert resp.status == 400
            assert "non-negative integers" in await resp.text()


async def next_frame(resp: aiohttp.ClientResponse) -> object:
    (length,) = FRAME_HEADER.unpack(await resp.content.readexactly(FRAME_HEADER.size))
    return decode(await resp.content.readexactly(length))


async def test_status_only_subscriber_gets_what_the_outlet_refused(
    session: aiohttp.ClientSession,
) -> None:
    """``events=0`` (a gateway reading JetStream): the start, status frames, and of the live
    events only those the JetStream outlet refused; a plain subscriber gets every event."""
    async with Sidecar() as sc:
        taken = [True]
        sc.stream.outlet = lambda frame: taken[0]
        url = f"{sc.url}/v1/kv-events"
        async with session.get(url, params={"events": "0"}) as quiet, session.get(url) as plain:
            assert isinstance(await next_frame(quiet), StreamStart)
            assert isinstance(await next_frame(plain), StreamStart)
            for resp in (quiet, plain):  # no position: a snapshot (of nothing yet)
                assert isinstance(await next_frame(resp), WorkerSnapshot)
            assert sc.stream.num_status_only == 1
            sc.store(0, 4)  # taken by JetStream: the quiet one does not see it
            sc.stream.broadcast(WorkerStatus("w0", 1))
            taken[0] = False
            sc.store(4, 8)  # refused (NATS away): everyone gets it
            assert [type(await next_frame(quiet)) for _ in range(2)] == [WorkerStatus,
                                                                        BlockStored]
            assert [type(await next_frame(plain)) for _ in range(3)] == [BlockStored,
                                                                        WorkerStatus,
                                                                        BlockStored]


async def test_a_new_subscriber_gets_the_workers_status_after_its_start(
    session: aiohttp.ClientSession,
) -> None:
    """A gateway routes to a sidecar worker only once it has a status: a new subscriber gets
    the worker's status now right after its snapshot (or replayed backlog), not a report
    interval later."""
    async with Sidecar() as sc:
        sc.stream.status = lambda: WorkerStatus("w0", 7, False, "engine down", "agg", 64)
        async with session.get(f"{sc.url}/v1/kv-events") as resp:
            assert isinstance(await next_frame(resp), StreamStart)
            assert isinstance(await next_frame(resp), WorkerSnapshot)
            async with asyncio.timeout(10):  # no report interval runs here: none else comes
                status = await next_frame(resp)
            assert isinstance(status, WorkerStatus)
            assert (status.routable, status.reason) == (False, "engine down")


async def test_snapshot_token_ids_go_to_a_gateway_that_hashes_them(
    session: aiohttp.ClientSession,
) -> None:
    """A feed whose index keeps an XXH3 table gets the snapshot's token ids and translates
    the blocks it holds; one without asks ``tokens=0`` and gets a snapshot without them."""
    async with Sidecar(block_size=4) as sc:
        tokens = list(range(1, 17))
        ns = namespace_seed("m")
        chain = BlockHasher(4).hash_tokens(tokens, ns)
        sc.stream.publish(BlockStored("engine", 0, 0, Tier.GPU, chain, None, tokens))
        url = f"{sc.url}/v1/kv-events"
        async with session.get(url, params={"tokens": "0"}) as bare, session.get(url) as full:
            for resp, count in ((bare, 0), (full, 4)):
                assert isinstance(await next_frame(resp), StreamStart)
                snapshot = await next_frame(resp)
                assert isinstance(snapshot, WorkerSnapshot)
                assert len(snapshot.tiers[0].token_ids) == count
        router = KvRouter(block_size=4)
        rolling = router.index.observer = RollingHashMap()
        _, task = await start_feed(sc.url, session, router)
        await eventually(lambda: rolling.canonical(ns, rolling_hashes(tokens, 4, 1337)) == chain,
                         "the snapshot's blocks translated")
        await stop(task)
        plain, plain_task = await start_feed(sc.url, session, KvRouter(block_size=4))
        await eventually(lambda: plain.router.index.match(chain) == {"w0": 4}, "the snapshot")
        await stop(plain_task)
        assert [q.get("tokens") for q in sc.queries] == ["0", None, None, "0"]
