"""The sidecar as a real process beside a real reference engine (simulated compute)."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import aiohttp
import pytest

from kvcore import BlockHasher, Namespace
from kvcore.events import Tier
from kvsidecar.launch import ManagedProcess
from kvsidecar.local_stack import EngineSpec, LocalStack, StackSpec
from routing.placement.kv_router import KvRouter
from routing.workers.event_feed import SidecarFeed
from tests.support.polling import eventually, wait_http_ok_async

HASHER = BlockHasher(16)


def local(tmp: Path, *sidecar_args: str, speedup: int = 20, workers: tuple[str, ...] = ("r0",),
          store: Literal["none", "sidecar"] = "none") -> LocalStack:
    """The reference engine (simulated compute) serving ``workers``, a sidecar beside each
    given ``sidecar_args`` (``store="sidecar"``: with a block store), no gateway."""
    engine = EngineSpec(replicas=len(workers), worker_ids=workers, store=store,
                        sidecar_args=sidecar_args)
    return LocalStack(StackSpec(engines=(engine,), gateways=(), speedup=speedup), tmp)


def parts(stack: LocalStack, worker: str = "r0") -> tuple[ManagedProcess, ManagedProcess]:
    """Worker ``worker``'s engine process and its sidecar's."""
    sidecar = next(p.proc for p in stack.sidecars if p.worker_id == worker)
    assert isinstance(sidecar, ManagedProcess)
    return stack.process(worker), sidecar


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[ManagedProcess, ManagedProcess]]:
    with local(tmp_path) as started:
        eng, sc = parts(started)
        yield eng, sc
        assert sc.stop() == 0, sc.log_tail()


async def generate(
    session: aiohttp.ClientSession,
    url: str,
    tokens: list[int],
    rid: str,
    stream: bool = False,
    max_tokens: int = 4,
) -> dict[str, object]:
    body = {
        "request_id": rid,
        "model": "tiny",
        "kind": "completion",
        "prompt_token_ids": tokens,
        "max_tokens": max_tokens,
        "stream": stream,
        "include_usage": True,
    }
    async with session.post(f"{url}/v1/kvsidecar/generate", json=body) as resp:
        if not stream:
            return {
                "status": resp.status,
                "body": await resp.json(),
                "rid": resp.headers.get("x-request-id"),
            }
        chunks = [line async for line in resp.content if line.startswith(b"data:")]
        return {"status": resp.status, "chunks": chunks}


def prompt(salt: int, n_blocks: int = 6) -> list[int]:
    return [(salt * 131 + i) % 900 + 10 for i in range(16 * n_blocks)]


def overlap(feed: SidecarFeed, tokens: list[int]) -> dict[Tier, dict[str, int]]:
    return feed.router.index.match_tiers(HASHER.hash_tokens(tokens, Namespace("tiny").seed))


@pytest.mark.slow
class TestSidecarWithEngine:
    async def test_proxy_answers_and_events_reach_the_gateway(self, stack, session) -> None:  # type: ignore[no-untyped-def]
        """Requests go through the proxy; the engine's stored blocks reach a gateway feed."""
        _, sc = stack
        tokens = prompt(1)
        first = await generate(session, sc.url, tokens, "a")
        assert first["status"] == 200 and first["rid"] == "a"
        feed = SidecarFeed(sc.url, KvRouter(), session, model_id="tiny")
        task = asyncio.create_task(feed.run())
        await eventually(lambda: overlap(feed, tokens).get(Tier.GPU) == {"r0": 6},
                         "the stored blocks at the gateway")
        streamed = await generate(session, sc.url, tokens, "b", stream=True)
        assert streamed["chunks"][-1] == b"data: [DONE]\n"
        usage = json.loads(streamed["chunks"][-2][5:])["usage"]
        # As in SGLang, the last page is recomputed to produce the first token's logits.
        assert usage["prompt_tokens_details"]["cached_tokens"] == 80
        task.cancel()

    async def test_reconnecting_subscriber_converges(self, stack, session) -> None:  # type: ignore[no-untyped-def]
        """A gateway that drops mid-stream and resumes matches one that never dropped."""
        _, sc = stack
        steady = SidecarFeed(sc.url, KvRouter(), session, model_id="tiny")
        flaky = SidecarFeed(sc.url, KvRouter(), session, model_id="tiny")
        tasks = [asyncio.create_task(steady.run()), asyncio.create_task(flaky.run())]
        await eventually(lambda: steady.connected and flaky.connected, "both feeds to connect")
        await generate(session, sc.url, prompt(2), "c")
        tasks[1].cancel()
        for i in range(5):
            await generate(session, sc.url, prompt(10 + i), f"d{i}")
        tasks[1] = asyncio.create_task(flaky.run())
        await eventually(lambda: flaky.connected and flaky.stats.connects == 2,
                         "the flaky feed to reconnect")
        await generate(session, sc.url, prompt(20), "e")
        await eventually(
            lambda: (
                flaky.router.index.position("r0") == steady.router.index.position("r0")
                and steady.router.index.position("r0") is not None
                and overlap(steady, prompt(20)).get(Tier.GPU) == {"r0": 6}
            ),
            "both feeds to reach the same position",
        )
        for salt in (2, 10, 14, 20):
            assert overlap(flaky, prompt(salt)) == overlap(steady, prompt(salt))
        for task in tasks:
            task.cancel()

    async def test_engine_restart_resyncs_the_mirror(self, tmp_path: Path, session) -> None:  # type: ignore[no-untyped-def]
        """An engine that restarts with an empty cache clears what the gateway believed."""
        async with local(tmp_path) as started:
            eng, sc = parts(started)
            feed = SidecarFeed(sc.url, KvRouter(), session, model_id="tiny")
            task = asyncio.create_task(feed.run())
            await generate(session, sc.url, prompt(3), "f")
            await eventually(lambda: overlap(feed, prompt(3)).get(Tier.GPU) == {"r0": 6},
                             "the first engine's blocks at the gateway")
            # The restarted engine comes back with the same configuration: the HTTP port and
            # the KV event endpoints it had bound (LocalStack.restart binds them again).
            eng.kill()
            await asyncio.to_thread(started.restart, eng)
            await wait_http_ok_async(session, f"{sc.url}/health",
                                     "the sidecar to see the engine come back", timeout_s=30)
            await generate(session, sc.url, prompt(4), "g")
            await eventually(lambda: overlap(feed, prompt(4)).get(Tier.GPU) == {"r0": 6},
                             "the restarted engine's blocks at the gateway", timeout_s=30)
            assert overlap(feed, prompt(3)) == {}
            task.cancel()
            assert sc.stop() == 0, sc.log_tail()

    async def test_silent_engine_is_reported_unroutable(self, tmp_path: Path, session) -> None:  # type: ignore[no-untyped-def]
        """A request that stored new blocks, then a canary's, with no KV event: /health says
        why (the re-check and the way back: tests/integration/sidecar/test_kv_event_silence)."""
        # Listen to an endpoint nobody publishes on: the engine serves, events never arrive.
        silent = ("--kv-events-endpoint", "tcp://127.0.0.1:9", "--block-size", "16",
                  "--silent-after-s", "0.3")
        async with local(tmp_path, *silent) as started:
            _, sc = parts(started)
            for i in range(3):
                await generate(session, sc.url, prompt(5), f"h{i}")

            async def health() -> dict[str, object]:
                async with session.get(f"{sc.url}/health") as resp:
                    return {"http": resp.status, **(await resp.json())}

            async def unhealthy() -> dict[str, object] | None:
                body = await health()
                return None if body["http"] == 200 else body

            body = await eventually(unhealthy, "/health to report the silence", timeout_s=10,
                                    interval_s=0.05)
            assert body["http"] == 503 and body["routable"] is False
            assert "published no KV event" in str(body["reason"])
            assert body["kv_events"]["canaries_sent"] >= 1  # re-checked before the verdict

    async def test_sigterm_drains_and_exits_zero(self, tmp_path: Path, session) -> None:  # type: ignore[no-untyped-def]
        """SIGTERM mid-request lets the request finish, then the sidecar exits 0."""
        async with local(tmp_path, speedup=1) as started:
            eng, sc = parts(started)
            # The engine is stopped until the signal has landed: the request is in flight
            # then, however fast the engine would have answered it.
            with eng.paused():
                pending = asyncio.create_task(
                    generate(session, sc.url, prompt(6), "i", max_tokens=64))
                await eventually(lambda: in_flight_is(session, sc.url, 1),
                                 "the request to be in flight", timeout_s=10, interval_s=0.005)
                sc.proc.send_signal(signal.SIGTERM)

                async def draining() -> bool:
                    async with session.get(f"{sc.url}/health") as resp:
                        return bool((await resp.json())["draining"])

                await eventually(draining, "the sidecar to drain", timeout_s=10)
            result = await pending
            assert result["status"] == 200
            assert sc.stop() == 0

    async def test_bad_requests_get_clear_errors(self, stack, session) -> None:  # type: ignore[no-untyped-def]
        """Malformed JSON and bad fields get 400 in OpenAI's shape; the sidecar keeps serving."""
        _, sc = stack
        for body in (
            b"{not json",
            b'{"request_id": "x"}',
            json.dumps(
                {"request_id": "x", "model": "tiny", "kind": "completion", "prompt_token_ids": []}
            ).encode(),
        ):
            async with session.post(f"{sc.url}/v1/kvsidecar/generate", data=body) as resp:
                assert resp.status == 400
                assert "message" in (await resp.json())["error"]
        ok = await generate(session, sc.url, prompt(7), "j")
        assert ok["status"] == 200


async def in_flight(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(f"{url}/v1/load") as resp:
        return int((await resp.json())["r0"]["in_flight"])


async def in_flight_is(session: aiohttp.ClientSession, url: str, count: int) -> bool:
    return await in_flight(session, url) == count


@pytest.mark.slow
async def test_host_store_puts_reach_the_gateway_as_host_tier(tmp_path: Path, session) -> None:  # type: ignore[no-untyped-def]
    """Blocks an engine hook puts in the sidecar's store, keyed by their pages' hashes as
    SGLang's HiCache hook keys them, appear in the gateway's host tier by canonical hash."""
    import numpy as np

    from adapters.sglang.hicache_keys import HiCacheKeyMap
    from refengine.page_hash import page_digests
    from shm import BlockStoreClient

    sizes = ("--store-capacity-bytes", "1MiB", "--store-block-bytes", "4KiB")
    async with local(tmp_path, *sizes, store="sidecar") as started:
        _, sc = parts(started)
        sock = started.store_sockets["r0"]
        feed = SidecarFeed(sc.url, KvRouter(), session, model_id="tiny")
        task = asyncio.create_task(feed.run())
        await generate(session, sc.url, prompt(8), "p")  # its events name the pages
        await eventually(lambda: overlap(feed, prompt(8)).get(Tier.GPU) == {"r0": 6},
                         "the engine's blocks at the gateway")
        keys = HiCacheKeyMap("tiny").store_keys(
            [d.hex() for d in page_digests(prompt(8), 16)])
        data = [np.full(4096, i, dtype=np.uint8) for i in range(len(keys))]
        with BlockStoreClient(str(sock)) as store:
            store.put_many(keys, data, parent_hashes=[None, *(k[1] for k in keys[:-1])])
            outs = [np.empty(4096, dtype=np.uint8) for _ in keys]
            assert store.get_many(keys, outs) == [True] * len(keys)
        assert all((o == i).all() for i, o in enumerate(outs))
        await eventually(lambda: overlap(feed, prompt(8)).get(Tier.HOST) == {"r0": 6},
                         "the stored blocks in the gateway's host tier")
        async with session.get(f"{sc.url}/metrics") as resp:
            text = await resp.text()
        assert 'kvsidecar_store_lookups_total{result="hit"} 6.0' in text
        # The writer's slots granted ahead of a next put went back when it disconnected.
        assert 'kvsidecar_store_blocks{kind="granted"} 0.0' in text
        task.cancel()
        assert sc.stop() == 0, sc.log_tail()
        assert not sock.exists()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", pytest.param("nixl", marks=pytest.mark.nixl), "tcp"])
async def test_peer_sidecar_imports_blocks(tmp_path: Path, session, transport: str) -> None:  # type: ignore[no-untyped-def]
    """A sidecar pulls a peer sidecar's host-tier blocks by shm, NIXL or TCP; bytes match."""
    import numpy as np

    from shm import BlockStoreClient

    if transport == "nixl":
        pytest.importorskip("nixl_cu12", reason="the nixl extra (nixl-cu12) is not installed")
    sizes = ("--store-capacity-bytes", "2MiB", "--store-block-bytes", "64KiB")
    async with local(tmp_path, *sizes, workers=("peer-a", "peer-b"), store="sidecar") as started:
        sockets = started.store_sockets
        a, b = (started.sidecar_urls[f"peer-{name}"] for name in ("a", "b"))
        seed = Namespace("tiny").seed
        blocks = HASHER.hash_tokens(prompt(30, 8), seed)
        data = [
            np.random.default_rng(i).integers(0, 256, 65536, dtype=np.uint8)
            for i in range(len(blocks))
        ]
        with BlockStoreClient(str(sockets["peer-a"])) as store:
            store.put_many([(seed, h) for h in blocks], data)
        body = {"peer_url": a, "keys": [[seed, h] for h in blocks], "transport": transport}
        async with session.post(f"{b}/v1/blocks/pull", json=body) as resp:
            assert resp.status == 200, await resp.text()
        outs = [np.empty(65536, dtype=np.uint8) for _ in blocks]
        with BlockStoreClient(str(sockets["peer-b"])) as store:
            assert store.get_many([(seed, h) for h in blocks], outs) == [True] * len(blocks)
        assert all((o == d).all() for o, d in zip(outs, data, strict=True))
        async with session.get(f"{b}/metrics") as resp:
            metrics = await resp.text()
        expected = f'kvsidecar_transfer_bytes_total{{outcome="ok",transport="{transport}"}} '
        assert expected + f"{len(blocks) * 65536}.0" in metrics
        for name in ("peer-a", "peer-b"):
            _, proc = parts(started, name)
            assert proc.stop() == 0, proc.log_tail()


@pytest.mark.slow
async def test_client_disconnect_aborts_the_engine_request(tmp_path: Path, session) -> None:  # type: ignore[no-untyped-def]
    """A client that goes away mid-stream makes the sidecar abort the engine's request."""
    async with local(tmp_path, speedup=1) as started:
        eng, sc = parts(started)

        async def running() -> int:
            async with session.get(f"{eng.url}/v1/loads") as resp:
                body = await resp.json()
            loads = body["loads"] if isinstance(body, dict) and "loads" in body else body
            return sum(int(x["num_running_reqs"]) for x in loads)

        body = {
            "request_id": "long",
            "model": "tiny",
            "kind": "completion",
            "prompt_token_ids": prompt(9),
            "max_tokens": 4000,
            "stream": True,
            "ignore_eos": True,
        }  # ~30 s of decoding at 8 ms a step
        async with (
            aiohttp.ClientSession() as client,
            client.post(f"{sc.url}/v1/kvsidecar/generate", json=body) as resp,
        ):
            await resp.content.readline()
            assert await running() == 1
        # leaving the block closed the client's connection mid-stream
        async def stopped() -> bool:
            return not await running()

        await eventually(stopped, "the engine to stop generating for a gone client",
                         timeout_s=10, interval_s=0.05)
        assert await in_flight(session, sc.url) == 0
