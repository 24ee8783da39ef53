"""Fakes at the engine boundary, for the adapter contract suite (tests only).

Each fake speaks one engine's *wire format* on real sockets, on ephemeral ports:

* ``FakeSGLangPublisher``: ZMQ PUB + ROUTER with SGLang's framing, replay buffer and end
  marker (what ``ZmqEventPublisher`` does), plus knobs to drop a live batch (a gap) and to
  restart (seq back to 0, buffer emptied, same ports);
* ``FakeVllmPublisher``: the same for vLLM, whose replies carry no topic frame, whose stored
  events name a salt in ``extra_keys`` and which publishes nothing when it starts;
* ``FakeTrtllmServer``: an aiohttp ``POST /kv_cache_events`` that drains its queue, as
  ``trtllm-serve`` does, with event ids that start over on restart.

Both are driven with engine-neutral ops (``store``/``remove``/``clear``/``restart``/``gap``/
``garbage``) so one scenario runs against every adapter; ``truth`` tracks what the engine
really holds, in engine hashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
import orjson
import zmq
import zmq.asyncio
from aiohttp import web

from tests.support.polling import eventually
from tests.unit.adapters import trtllm_fixtures as trt


class Truth:
    """What the fake engine holds: engine hash → (parent, tokens)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, list[int]]] = {}

    def store(self, hashes: list[int], parent: int | None, tokens: list[int], bs: int) -> None:
        prev = parent
        for i, h in enumerate(hashes):
            self.blocks[h] = (prev, tokens[i * bs : (i + 1) * bs])
            prev = h

    def token_path(self, h: int) -> list[int]:
        """All tokens from the root to the end of block ``h``."""
        parts = []
        cur: int | None = h
        while cur is not None:
            parent, tokens = self.blocks[cur]
            parts.append(tokens)
            cur = parent
        return [t for part in reversed(parts) for t in part]


class FakeSGLangPublisher:
    """SGLang's ZmqEventPublisher wire behaviour on loopback (PUB + replay ROUTER)."""

    clears_on_start = True  # SGLang's radix cache reset at start-up is published

    def __init__(
        self, block_size: int, topic: bytes = b"",
        bind: tuple[str, str] = ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
    ) -> None:
        self.block_size = block_size
        self.topic = topic
        self.ctx = zmq.asyncio.Context()
        self.truth = Truth()
        self._seq = 0
        self._buffer: list[tuple[int, bytes]] = []
        self._drop_next = 0
        try:
            self._bind(*bind)
        except zmq.ZMQError:
            self.ctx.term()
            raise

    def _bind(self, pub_endpoint: str, replay_endpoint: str) -> None:
        pub = self.ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        try:
            pub.bind(pub_endpoint)
            router.bind(replay_endpoint)
        except zmq.ZMQError:
            pub.close(linger=0)
            router.close(linger=0)
            raise
        self.pub, self.router = pub, router
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._server = asyncio.get_running_loop().create_task(self._serve_replay())

    async def _serve_replay(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if seq >= first:
                    await self.router.send_multipart(
                        [ident, *self.reply_frames(seq.to_bytes(8, "big"), payload)]
                    )
            await self.router.send_multipart([ident, *self.reply_frames(b"\xff" * 8, b"")])

    def reply_frames(self, seq: bytes, payload: bytes) -> list[bytes]:
        """One replayed message after the client's identity (SGLang's names the topic)."""
        return [b"", self.topic, seq, payload]

    async def publish(self, events: list[dict[str, Any]]) -> None:
        payload = msgspec.msgpack.encode([time.time(), events, 0])
        await self.publish_raw(payload)

    async def publish_raw(self, payload: bytes) -> None:
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if self._drop_next:
            self._drop_next -= 1
            return
        await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    # --- engine-neutral ops --------------------------------------------------------------

    async def store(
        self, hashes: list[int], parent: int | None, tokens: list[int], salt: str | None = None
    ) -> None:
        self.truth.store(hashes, parent, tokens, self.block_size)
        await self.publish([self.stored_event(hashes, parent, tokens, salt)])

    def stored_event(
        self, hashes: list[int], parent: int | None, tokens: list[int], salt: str | None
    ) -> dict[str, Any]:
        event: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": self.block_size,
            "lora_id": None,
            "medium": "GPU",
        }
        if salt is not None:
            event["cache_salt"] = salt
        return event

    async def remove(self, hashes: list[int]) -> None:
        for h in hashes:
            self.truth.blocks.pop(h, None)
        await self.publish([{"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}])

    async def clear(self) -> None:
        self.truth.blocks.clear()
        await self.publish([{"type": "AllBlocksCleared"}])

    async def garbage(self) -> None:
        await self.publish([{"type": "BlockTeleported", "block_hashes": [1]}])

    def gap(self, n: int = 1) -> None:
        """The next ``n`` batches never reach subscribers live (they stay replayable)."""
        self._drop_next = n

    def reset_counter(self) -> None:
        """Seq from 0 and an empty buffer on the same sockets: a restart no reconnect shows."""
        self._seq = 0
        self._buffer = []

    async def restart(self) -> None:
        """A new engine process on the same ports: seq from 0, empty buffer and cache."""
        await self._close_sockets()
        self.reset_counter()
        self.truth = Truth()

        def bound() -> bool:
            try:
                self._bind(self.endpoint, self.replay_endpoint)
            except zmq.ZMQError as exc:
                raise AssertionError(f"cannot bind yet: {exc}") from exc
            return True

        # The old sockets close asynchronously: retry the bind until the ports are free.
        await eventually(bound, "the old ports to be free again", timeout_s=5.0, interval_s=0.01)
        if self.clears_on_start:
            await self.clear()

    async def _close_sockets(self) -> None:
        self._server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._server
        self.pub.close(linger=0)
        self.router.close(linger=0)

    async def aclose(self) -> None:
        await self._close_sockets()
        self.ctx.term()


class FakeVllmPublisher(FakeSGLangPublisher):
    """vLLM's ZmqEventPublisher wire behaviour on loopback (``vllm/distributed/kv_events.py``)."""

    clears_on_start = False  # a fresh vLLM has nothing and says nothing

    def reply_frames(self, seq: bytes, payload: bytes) -> list[bytes]:
        return [b"", seq, payload]  # vLLM's replay names no topic

    def stored_event(
        self, hashes: list[int], parent: int | None, tokens: list[int], salt: str | None
    ) -> dict[str, Any]:
        event: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": self.block_size,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        if salt is not None:  # the salt goes into a prompt's first block's hash only
            event["extra_keys"] = [[salt], *[None] * (len(hashes) - 1)]
        return event


class FakeTrtllmPublisher(FakeSGLangPublisher):
    """One rank of TensorRT-LLM 1.4's ``ZmqEventPublisher`` on loopback: its replay names the
    topic (``[b"", topic, seq, payload]``), as SGLang's does; a fresh engine says nothing.
    Its batches are the fixtures' (``publish_raw``)."""

    clears_on_start = False


class FakeTrtllmServer:
    """``trtllm-serve``'s draining ``POST /kv_cache_events`` on an ephemeral port."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.truth = Truth()
        self.queue: list[bytes] = []  # serialized envelopes
        self.polls = 0
        self.fail_polls = 0  # answer this many polls with 503
        self._event_id = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/kv_cache_events", self._drain)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        self.push(trt.created())

    async def _drain(self, request: web.Request) -> web.Response:
        self.polls += 1
        if self.fail_polls:
            self.fail_polls -= 1
            return web.Response(status=503, text="engine starting")
        items, self.queue = self.queue, []
        return web.Response(body=b"[" + b",".join(items) + b"]", content_type="application/json")

    def push(self, data: dict[str, Any]) -> None:
        self.queue.append(orjson.dumps(trt.envelope(self._event_id, data)))
        self._event_id += 1

    async def store(
        self, hashes: list[int], parent: int | None, tokens: list[int], salt: str | None = None
    ) -> None:
        bs = self.block_size
        self.truth.store(hashes, parent, tokens, bs)
        blocks = [
            trt.block(h, tokens[i * bs : (i + 1) * bs], cache_salt=salt)
            for i, h in enumerate(hashes)
        ]
        self.push(trt.stored(parent, blocks))

    async def remove(self, hashes: list[int]) -> None:
        for h in hashes:
            self.truth.blocks.pop(h, None)
        self.push(trt.removed(hashes))

    async def clear(self) -> None:
        # TensorRT-LLM has no "cleared" event: removing every block is how it looks.
        hashes = list(self.truth.blocks)
        self.truth.blocks.clear()
        if hashes:
            self.push(trt.removed(hashes))

    async def garbage(self) -> None:
        self.queue.append(b'{"event_id": ' + str(self._event_id).encode() + b', "data": 7}')
        self._event_id += 1

    def gap(self, n: int = 1) -> None:
        """The next ``n`` event ids are lost (the engine's event buffer overflowed)."""
        self._event_id += n

    async def restart(self) -> None:
        self._event_id = 0
        self.queue = []
        self.truth = Truth()
        self.push(trt.created())

    async def aclose(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
