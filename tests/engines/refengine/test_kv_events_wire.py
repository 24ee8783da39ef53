"""KV events read by an independent subscriber written against SGLang's wire format with plain
pyzmq + msgpack (no refengine or msgspec code): framing, hashes, replay and its end marker."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import zmq

from tests.support.polling import wait_until

pytestmark = pytest.mark.slow  # real processes, seconds a test

END = b"\xff" * 8
TOPIC = b"kv-events"


def sglang_hashes(tokens: list[int], page: int, salt: str | None = None) -> list[int]:
    """SGLang's event hashes, re-derived: SHA-256 chain over u32-LE pages, first 8 bytes BE."""
    prior = hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).digest() if salt else b""
    out = []
    for i in range(len(tokens) // page):
        prior = hashlib.sha256(prior + struct.pack(f"<{page}I", *tokens[i * page : (i + 1) * page]))
        prior = prior.digest()
        out.append(int.from_bytes(prior[:8], "big", signed=True))
    return out


class Subscriber:
    def __init__(self, endpoint: str, replay: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(endpoint)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(replay)
        self.live: dict[int, bytes] = {}

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=0)
        self.ctx.term()

    def read_live(self, timeout_ms: int) -> bool:
        if not self.sub.poll(timeout_ms):
            return False
        frames = self.sub.recv_multipart()
        assert len(frames) == 3 and frames[0] == TOPIC and len(frames[1]) == 8
        self.live[int.from_bytes(frames[1], "big")] = frames[2]
        return True

    def join(self, nudge: Callable[[], None]) -> None:
        """Until a live batch arrives, ``nudge`` the engine into publishing (a slow joiner)."""

        def heard() -> bool:
            if self.read_live(100):
                return True
            nudge()
            return False

        wait_until(heard, "a live event", timeout_s=20, interval_s=0)

    def read_until(self, done: Callable[[], bool], what: str) -> None:
        """Read live batches until ``done()`` holds."""

        def caught_up() -> bool:
            if done():
                return True
            self.read_live(100)
            return False

        wait_until(caught_up, what, timeout_s=20, interval_s=0)

    def replay(self, start: int) -> dict[int, bytes]:
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out: dict[int, bytes] = {}
        while True:
            assert self.dealer.poll(10_000), "replay did not answer"
            frames = self.dealer.recv_multipart()
            assert frames[0] == b""
            if frames[2] == END:
                assert frames == [b"", b"", END, b""]
                return out
            assert len(frames) == 4 and frames[1] == TOPIC
            out[int.from_bytes(frames[2], "big")] = frames[3]


def decode(payload: bytes) -> tuple[float, list[dict[str, Any]], int]:
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    return ts, events, rank


def _generate(h: Any, url: str, ids: list[int], salt: str | None = None) -> None:
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
    if salt:
        body["cache_salt"] = salt
    assert h.http("POST", url + "/generate", body)[0] == 200


def test_events_decode_and_hashes_match_sglang(h: Any, small_engine: Any) -> None:
    """Stored/removed/cleared events, hashes, parents, salt, and live == replay bytes."""
    info = h.http("GET", small_engine.url + "/server_info")[1]["kv_events"]
    host = "127.0.0.1"
    sub = Subscriber(
        f"tcp://{host}:{info['endpoint_port_base']}",
        f"tcp://{host}:{info['replay_endpoint_port_base']}",
    )
    try:
        sub.join(lambda: _generate(h, small_engine.url, [1] * 17))
        prompt = list(range(300, 300 + 67))  # 4 full pages + 3 tokens
        _generate(h, small_engine.url, prompt)
        _generate(h, small_engine.url, prompt[:40], salt="tenant-A")
        for i in range(12):  # fill the pool: forces evictions
            _generate(h, small_engine.url, [500 + i] * 48)
        assert h.http("POST", small_engine.url + "/flush_cache")[0] == 200
        replayed = sub.replay(0)
        last = max(replayed)
        sub.read_until(lambda: last in sub.live, "the live stream to reach the replay's end")
    finally:
        sub.close()

    assert sorted(replayed) == list(range(last + 1))  # seq from 0, no holes
    for seq, payload in sub.live.items():  # live and replay carry identical bytes
        assert replayed[seq] == payload
    batches = [decode(replayed[s]) for s in sorted(replayed)]
    assert all(rank == 0 and ts > 0 for ts, _, rank in batches)
    events = [e for _, evs, _ in batches for e in evs]
    assert events[0] == {"type": "AllBlocksCleared"}  # start-up reset, seq 0
    assert events[-1] == {"type": "AllBlocksCleared"}  # /flush_cache
    stored = [e for e in events if e["type"] == "BlockStored"]
    for e in stored:
        assert set(e) <= {
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "cache_salt",
        }
        assert e["lora_id"] is None and e["medium"] == "GPU" and e["block_size"] == 16
        assert len(e["token_ids"]) == 16 * len(e["block_hashes"])
    want = sglang_hashes(prompt, 16)
    mine = next(e for e in stored if e["block_hashes"][0] == want[0])
    assert mine["block_hashes"] == want and mine["parent_block_hash"] is None
    assert mine["token_ids"] == prompt[:64] and "cache_salt" not in mine
    salted = next(e for e in stored if e.get("cache_salt") == "tenant-A")
    assert salted["block_hashes"] == sglang_hashes(prompt[:40], 16, "tenant-A")
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert removed and all(e["medium"] == "GPU" for e in events if e["type"] == "BlockRemoved")
    known = {h for e in stored for h in e["block_hashes"]}
    assert set(removed) <= known


def test_replay_fills_a_deliberate_gap(h: Any, engine: Any) -> None:
    """Dropping a live batch and replaying from it recovers the same bytes and the rest."""
    ready = engine.ready[0]
    sub = Subscriber(ready["kv_events_endpoint"], ready["kv_replay_endpoint"])
    try:
        sub.join(lambda: _generate(h, engine.url, [2] * 33))
        for i in range(4):
            _generate(h, engine.url, [700 + i] * 40)
        first = min(sub.live)
        sub.read_until(lambda: len(sub.live) >= 5, "five live batches")
        gap = sorted(sub.live)[2]
        dropped = sub.live.pop(gap)  # the deliberate gap
        got = sub.replay(gap)
    finally:
        sub.close()
    assert got[gap] == dropped
    assert min(got) == gap and sorted(got) == list(range(gap, max(got) + 1))
    assert set(sub.live) - {gap} <= set(got) | set(range(first, gap))


def test_malformed_replay_requests_are_ignored(h: Any, engine: Any) -> None:
    """A replay request of the wrong shape gets no answer; a good one still does."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(engine.ready[0]["kv_replay_endpoint"])
    try:
        dealer.send_multipart([b"", b"\x00\x01"])  # 2-byte seq: invalid
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = []
        while True:
            assert dealer.poll(10_000)
            frames = dealer.recv_multipart()
            if frames[2] == END:
                break
            assert int.from_bytes(frames[2], "big") >= 0
    finally:
        dealer.close(linger=0)
        ctx.term()
