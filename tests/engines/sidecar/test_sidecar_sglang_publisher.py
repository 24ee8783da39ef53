"""The sidecar process relaying SGLang's own KV-event publisher (the `sglang` extra).

SGLang's real ``ZmqEventPublisher`` runs in the test on loopback; the sidecar (a real
process) subscribes to it through ``--kv-events-endpoint`` while a reference engine answers
its HTTP side. A gateway feed follows the sidecar's stream: it must see SGLang's blocks,
a swallowed batch filled by SGLang's replay, and a publisher restart clearing the old epoch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest

kv_events = pytest.importorskip("sglang.srt.disaggregation.kv_events")

from kvcore import BlockHasher, Namespace  # noqa: E402
from kvcore.events import Tier  # noqa: E402
from kvsidecar.launch import ManagedProcess  # noqa: E402
from kvsidecar.local_stack import EngineSpec, ExternalPublisher, LocalStack, StackSpec  # noqa: E402
from routing.placement.kv_router import KvRouter  # noqa: E402
from routing.workers.event_feed import SidecarFeed  # noqa: E402
from tests.support.net import ports_free  # noqa: E402
from tests.support.polling import eventually  # noqa: E402
from tests.support.publishers import DropOneSend  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
PAGE = 16


def canonical(tokens: list[int]) -> list[int]:
    return BlockHasher(PAGE).hash_tokens(tokens, Namespace("m").seed)


def stored(hashes: list[int], tokens: list[int]) -> Any:
    return kv_events.BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=tokens,
        block_size=PAGE,
        lora_id=None,
        medium="GPU",
    )


def batch(*events: Any) -> Any:
    return kv_events.KVEventBatch(ts=time.time(), events=list(events))


async def test_sidecar_relays_sglangs_publisher(tmp_path: Path, session) -> None:  # type: ignore[no-untyped-def]
    """SGLang's blocks, a replayed gap and a publisher restart all reach the gateway."""
    pub = kv_events.ZmqEventPublisher(
        0,
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        bind=True,
        buffer_steps=1000,
    )
    live, replay = pub._local_pub_endpoint, pub._local_replay_endpoint
    spec = StackSpec(engines=(EngineSpec(
        worker_ids=("sg",), sidecar_args=("--model-id", "m", "--block-size", str(PAGE)),
        publisher=ExternalPublisher(events=live, replay=replay)),), gateways=())
    async with contextlib.AsyncExitStack() as cleanup:  # the feed, the stack, then SGLang's
        cleanup.push_async_callback(lambda: asyncio.to_thread(pub.shutdown))  # the latest
        stack = await cleanup.enter_async_context(LocalStack(spec, tmp_path))
        sidecar = stack.sidecars[0].proc
        assert isinstance(sidecar, ManagedProcess)
        feed = SidecarFeed(sidecar.url, KvRouter(), session, model_id="m")
        cleanup.callback(asyncio.create_task(feed.run()).cancel)
        await eventually(lambda: feed.connected, "the feed to connect")
        a, b, c = ([i] * PAGE for i in (1, 2, 3))

        def gpu(tokens: list[int]) -> dict[str, int]:
            return feed.router.index.match(canonical(tokens), Tier.GPU)

        pub.publish(batch(stored([11], a)))
        await eventually(lambda: gpu(a) == {"sg": 1}, "the first block at the gateway")
        pub._pub = DropOneSend(pub._pub, drop_seq=1)
        pub.publish(batch(stored([12], b)))  # seq 1 never goes out live
        pub.publish(batch(stored([13], c)))  # seq 2 reveals the gap; replay fills it
        await eventually(lambda: gpu(b) == {"sg": 1} and gpu(c) == {"sg": 1},
                         "the replayed gap and the next block at the gateway")

        await asyncio.to_thread(pub.shutdown)  # the engine restarts, its cache empty
        await eventually(lambda: ports_free(live, replay), "the old publisher's ports to be free")
        pub = kv_events.ZmqEventPublisher(
            0, endpoint=live, replay_endpoint=replay, bind=True, buffer_steps=1000
        )
        d = [4] * PAGE

        def heard() -> bool:
            """Whether the block arrived; if not, publish it again (the SUB may be reconnecting)."""
            if gpu(d) == {"sg": 1}:
                return True
            pub.publish(batch(stored([14], d)))
            return False

        await eventually(heard, "the restarted publisher to be heard", interval_s=0.2)
        assert gpu(a) == gpu(b) == gpu(c) == {}
        assert stack.stop_child(sidecar) == 0, sidecar.log_tail()
