"""The sidecar's events republished in vLLM's ZMQ wire format (``--publish-zmq``), read by a
real ZMQ subscriber and by vllm-router's ``kv_aware`` policy, beside reference engines."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import cbor2
import msgpack
import pytest
import zmq
import zmq.asyncio

from kvsidecar.local_stack import EngineSpec, LocalStack, StackSpec
from kvsidecar.local_vllm_router import VllmRouter
from tests.support.polling import eventually

PUBLISH = ["--publish-zmq", "tcp://127.0.0.1:*", "--publish-zmq-replay", "tcp://127.0.0.1:*"]
BS = 16
END = b"\xff" * 8

pytestmark = pytest.mark.slow


Pair = tuple[str, dict[str, Any]]  # an engine's URL, its sidecar's published endpoints


@asynccontextmanager
async def republishing(tmp: Path, replicas: int) -> AsyncIterator[list[Pair]]:
    """Engines (sim compute), each with its sidecar republishing (worker ``r<i>``)."""
    spec = StackSpec(engines=(EngineSpec(
        replicas=replicas, worker_ids=tuple(f"r{i}" for i in range(replicas)),
        sidecar_args=tuple(PUBLISH)),), gateways=(), speedup=20)
    async with LocalStack(spec, tmp) as stack:
        yield [(stack.engine_urls[part.worker_id], part.ready["zmq_publish"][part.worker_id])
               for part in stack.sidecars]


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[Pair]:
    async with republishing(tmp_path, 1) as (one,):
        yield one


@pytest.fixture
async def pairs(tmp_path: Path) -> AsyncIterator[list[Pair]]:
    async with republishing(tmp_path, 2) as two:
        yield two


def vllm_hashes(tokens: list[int], seed: str = "0") -> list[int]:
    """vLLM's sha256_cbor chain (``hash_block_tokens``) computed here, with cbor2."""
    def h(x: object) -> bytes:
        return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()

    parent, out = h(seed), []
    for i in range(0, len(tokens) - BS + 1, BS):
        parent = h((parent, tuple(tokens[i : i + BS]), None))
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


def prompt(salt: int, n_blocks: int = 6) -> list[int]:
    return [(salt * 131 + i) % 900 + 10 for i in range(BS * n_blocks)]


async def generate(session: aiohttp.ClientSession, engine: str, tokens: list[int]) -> None:
    body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": 2}}
    async with session.post(f"{engine}/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def chat(session: aiohttp.ClientSession, url: str, system: str, user: str) -> int:
    """One chat completion; the prompt tokens the engine had cached."""
    body = {"model": "tiny", "max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        usage = (await resp.json())["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def replay(endpoint: str, start: int, junk: bool = False) -> list[tuple[int, bytes]]:
    """vLLM's replay protocol: [b"", start] in, [b"", seq, payload]... then seq -1 (after
    a malformed request, with ``junk``, which gets no answer)."""
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        if junk:
            await dealer.send_multipart([b"", b"\x01"])
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert await dealer.poll(5000), "the replay socket did not answer"
            empty, seq, payload = await dealer.recv_multipart()
            assert empty == b""
            if seq == END:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)
        ctx.term()


def stored_blocks(payloads: list[bytes]) -> dict[int, tuple[int | None, list[int]]]:
    """Every stored block of these batches: hash → (parent hash, its tokens)."""
    blocks: dict[int, tuple[int | None, list[int]]] = {}
    for payload in payloads:
        ts, events, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and rank == 0
        for ev in events:
            if ev["type"] != "BlockStored":
                continue
            assert ev["block_size"] == BS and ev["medium"] == "GPU" and "lora_name" in ev
            parent = ev["parent_block_hash"]
            for j, h in enumerate(ev["block_hashes"]):
                blocks[h] = (parent, ev["token_ids"][j * BS : (j + 1) * BS])
                parent = h
    return blocks


async def test_subscriber_reads_vllm_format_with_vllm_hashes(
    pair: Pair, session: aiohttp.ClientSession
) -> None:
    """A SUB socket gets [topic, seq, batch]; the hashes are vLLM's sha256_cbor of the tokens,
    chained; replay from a seq returns that seq on, then the end marker."""
    engine, published = pair
    assert published["topic"] == "" and published["hash"] == "sha256_cbor"
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(published["endpoint"])
    live: list[tuple[int, bytes]] = []
    try:
        # A subscription takes effect some time after connect: store prompts until one
        # arrives, so none of what follows can be lost to it.
        warm = 100

        async def subscribed() -> bool:
            nonlocal warm
            warm += 1
            await generate(session, engine, prompt(warm, 1))
            if await sub.poll(200):
                live.append(_frames(await sub.recv_multipart()))
                return True
            return False

        await eventually(subscribed, "the subscription to take effect")
        tokens = prompt(1)
        await generate(session, engine, tokens)
        want = vllm_hashes(tokens)

        async def got_all() -> bool:
            while await sub.poll(100):
                live.append(_frames(await sub.recv_multipart()))
            return set(want) <= set(stored_blocks([p for _, p in live]))

        await eventually(got_all, "the prompt's blocks on the SUB socket")
        blocks = stored_blocks([p for _, p in live])
        parent = None
        for i, h in enumerate(want):  # each block chains on the one before, tokens and all
            assert blocks[h] == (parent, tokens[i * BS : (i + 1) * BS])
            parent = h
        seqs = [seq for seq, _ in live]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one per batch, no gap

        everything = await replay(published["replay_endpoint"], 0)
        assert [s for s, _ in everything] == list(range(len(everything)))
        assert dict(everything)[seqs[-1]] == live[-1][1]
        tail = await replay(published["replay_endpoint"], seqs[-1], junk=True)
        assert tail == [live[-1]]
    finally:
        sub.close(linger=0)
        ctx.term()


def _frames(frames: list[bytes]) -> tuple[int, bytes]:
    topic, seq, payload = frames
    assert topic == b"" and len(seq) == 8
    return int.from_bytes(seq, "big"), payload


@pytest.mark.peers
async def test_vllm_router_kv_aware_follows_the_republished_prefixes(
    tmp_path: Path, pairs: list[Pair], session: aiohttp.ClientSession
) -> None:
    """vllm-router --policy kv_aware, fed only our sidecars' events, sends each shared
    prefix to the engine that stored it (warmed directly, behind the router's back)."""
    router = VllmRouter.start(
        tmp_path, "vllm-router",
        {url: (pub["endpoint"], pub["replay_endpoint"]) for url, pub in pairs},
        policy="kv_aware", debug=True,
    )
    try:
        router.wait_ready()
        # Four prefixes, two stored on each engine: a router that guessed would rarely
        # send all four to their holders.
        systems = [f"You are assistant number {i}. " + "Answer with care and cite sources. " * 6
                   for i in range(4)]
        for i, system in enumerate(systems):
            await chat(session, pairs[i % 2][0], system, "warm up")  # stored on that engine
        for (url, pub) in pairs:  # wait until the router has read what each sidecar sent
            last = await _published_seq(pub["replay_endpoint"])
            await eventually(lambda url=url, last=last: _at_least(router.applied_seq(url), last),
                             f"vllm-router to read {url}'s events")
        for turn in range(4):
            for system in systems:
                cached = await chat(session, router.url, system, f"question {turn}")
                assert cached >= 4 * BS, router.log_tail()
    finally:
        router.stop()


def _at_least(seq: int | None, last: int) -> bool:
    return seq is not None and seq >= last


async def _published_seq(replay_endpoint: str) -> int:
    batches = await replay(replay_endpoint, 0)
    assert batches, "the sidecar published nothing"
    return batches[-1][0]
