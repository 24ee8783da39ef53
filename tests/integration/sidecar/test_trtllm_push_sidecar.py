"""A real sidecar (``--engine trtllm``) subscribed to TensorRT-LLM 1.4's pushed KV events: two
in-test ZMQ publishers, bound at the base ports plus their rank as TensorRT-LLM's are, send the
fixture frames (``tests/unit/adapters/fixtures/trtllm_push``) beside a stand-in trtllm-serve
(health and models; in push mode its ``/kv_cache_events`` has nothing to drain). The sidecar's
canonical stream per rank shows the blocks: those published before it started (rebuilt from
the replay sockets) and those published live."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
import zmq

from kvcore.events import BlockRemoved, BlockStored, Tier, WorkerSnapshot
from kvcore.hashing import BlockHasher
from kvcore.namespace import Namespace
from kvcore.stream import StreamStart
from kvcore.wire import FRAME_HEADER, decode
from kvsidecar.launch import ManagedProcess
from kvsidecar.stack_argv import publisher_flags, sidecar_argv
from kvsidecar.stack_spec import ExternalPublisher
from tests.support.processes import ProcessGroup
from tests.unit.adapters.fake_engines import FakeTrtllmPublisher
from tests.unit.adapters.fixtures.trtllm_push import make_frames

ROOT = Path(__file__).resolve().parents[3]
FRAMES = json.loads(Path(make_frames.OUT).read_text())
BS = FRAMES["block_size"]
TOPIC = FRAMES["topic"]
RANK0 = [bytes.fromhex(p) for p in FRAMES["ranks"]["0"]]
RANK1 = [bytes.fromhex(p) for p in FRAMES["ranks"]["1"]]
DEADLINE_S = 30.0

pytestmark = pytest.mark.slow


def h(tokens: list[int], lora: str | None = None) -> list[int]:
    return BlockHasher(BS).hash_tokens(tokens, Namespace("m", lora, None).seed)


def _port(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


@pytest.fixture
async def ranks() -> AsyncIterator[list[FakeTrtllmPublisher]]:
    """Two publishers at (P, R) and (P + 1, R + 1), as TensorRT-LLM's ranks bind."""
    for _ in range(20):
        first = FakeTrtllmPublisher(BS, topic=TOPIC.encode())
        p, r = _port(first.endpoint), _port(first.replay_endpoint)
        try:
            second = FakeTrtllmPublisher(BS, topic=TOPIC.encode(), bind=(
                f"tcp://127.0.0.1:{p + 1}", f"tcp://127.0.0.1:{r + 1}"))
        except zmq.ZMQError:
            await first.aclose()
            continue
        try:
            yield [first, second]
        finally:
            await first.aclose()
            await second.aclose()
        return
    pytest.fail("no two adjacent free port pairs on loopback")


async def next_frame(resp: aiohttp.ClientResponse) -> object:
    (length,) = FRAME_HEADER.unpack(await resp.content.readexactly(FRAME_HEADER.size))
    return decode(await resp.content.readexactly(length))


class Held:
    """What one worker's canonical stream says it holds in GPU, frame by frame."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.blocks: set[int] = set()
        self.removed: list[int] = []

    async def until(self, done: Callable[[Held], bool]) -> None:
        async with asyncio.timeout(DEADLINE_S):
            while not done(self):
                frame = await next_frame(self.resp)
                if isinstance(frame, WorkerSnapshot):
                    self.blocks = {b for t in frame.tiers if t.tier is Tier.GPU
                                   for b in t.block_hashes}
                elif isinstance(frame, BlockStored) and frame.tier is Tier.GPU:
                    self.blocks.update(frame.block_hashes)
                elif isinstance(frame, BlockRemoved) and frame.tier is Tier.GPU:
                    self.blocks.difference_update(frame.block_hashes)
                    self.removed.extend(frame.block_hashes)


async def test_sidecar_streams_each_ranks_pushed_blocks(
    tmp_path: Path, procs: ProcessGroup[ManagedProcess], standin: str,
    ranks: list[FakeTrtllmPublisher], session: aiohttp.ClientSession,
) -> None:
    """Blocks published before the sidecar started come from each rank's replay socket, live
    ones follow; rank r is worker ``w/dp<r>``; V2 and V1 hashes, a LoRA id, a multimodal
    block skipped and a removal all show in the canonical stream."""
    rank0, rank1 = ranks
    await rank0.publish_raw(RANK0[0])  # before the sidecar: replayed to it at start
    await rank0.publish_raw(RANK0[1])
    await rank1.publish_raw(RANK1[0])
    rank0_at = publisher_flags(ExternalPublisher(rank0.endpoint, rank0.replay_endpoint))
    argv = sidecar_argv(standin, "w", "agg", 0.0, [
        "--engine", "trtllm", "--model-id", "m", "--block-size", str(BS), *rank0_at,
        "--kv-events-ranks", "2", "--lora-adapter", "ad=3"])
    sc = procs.add(ManagedProcess.start("sidecar", ["sidecar", *argv], workdir=tmp_path, env={
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}))
    await asyncio.to_thread(sc.wait_ready, 60)
    async with session.get(f"{sc.url}/v1/workers") as resp:
        assert (await resp.json())["workers"] == ["w/dp0", "w/dp1"]

    chain = h([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    lora = h([40, 41, 42, 43, 44, 45, 46, 47], lora="ad")
    url = f"{sc.url}/v1/kv-events"
    async with session.get(url, params={"worker": "w/dp0"}) as r0, \
            session.get(url, params={"worker": "w/dp1"}) as r1:
        for resp in (r0, r1):
            assert resp.status == 200, await resp.text()
            assert isinstance(await next_frame(resp), StreamStart)
        held0, held1 = Held(r0), Held(r1)
        await held0.until(lambda s: set(chain) <= s.blocks)
        await held1.until(lambda s: set(lora) <= s.blocks)
        assert held0.blocks == set(chain) and held1.blocks == set(lora)

        await rank0.publish_raw(RANK0[2])  # live: a plain block, then a multimodal one
        await rank0.publish_raw(RANK0[3])  # the child block removed
        first_mm = h([20, 21, 22, 23])[0]
        await held0.until(lambda s: first_mm in s.blocks and chain[2] in s.removed)
        assert held0.blocks == {*chain[:2], first_mm}
        await rank1.publish_raw(RANK1[1])
        await held1.until(lambda s: lora[1] in s.removed)
        assert held1.blocks == {lora[0]}
