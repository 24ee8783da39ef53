"""The sidecar's KV events republished in vLLM's ZMQ wire format (``--publish-zmq``).

So a router that reads vLLM's events (vllm-router ``--policy kv_aware``, llm-d's indexer,
Dynamo) can place over an SGLang or TensorRT-LLM fleet through its sidecars. Per worker
(DP rank) of this sidecar, exactly what vLLM's ``ZmqEventPublisher`` serves:

* a **PUB** socket sending ``[topic, seq (8 bytes, big-endian), payload]``, the payload a
  msgpack ``[ts, [events], data_parallel_rank]`` (``adapters.vllm.wire.encode_batch``), ``seq``
  counting batches from 0 for as long as this process lives;
* a **ROUTER** replay socket: a client sends ``[b"", start_seq]`` and gets every buffered
  batch from ``start_seq`` on as ``[b"", seq, payload]``, then ``[b"", -1, b""]``.

Every event the relay takes is translated at once (``adapters.vllm.republish``: hashes
recomputed in the consumer's scheme), and each event-loop tick's events leave as one batch.
The last ``buffer_steps`` batches are kept for replay. PUB never waits: a subscriber too
slow for ZMQ's high-water mark loses batches and sees the gap in ``seq``, which the replay
socket fills. Worker ``i`` of a multi-rank sidecar binds the endpoints' ports plus ``i``,
as vLLM offsets its ranks'.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import structlog
import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, Metric

from adapters.vllm.block_hash import VllmHashAlgo
from adapters.vllm.republish import CANONICAL, VllmEventWriter
from adapters.vllm.wire import VlEvent, encode_batch
from adapters.zmq_events.endpoints import rank_address
from adapters.zmq_events.framing import END_SEQ, seq_frame
from kvcore.events import KVEvent
from kvcore.options import check_bounds, option
from sidecar.event_stream import EventStream

__all__ = ["PUBLISH_HASHES", "ZmqPublishConfig", "ZmqRepublisher"]

log = structlog.get_logger(component="zmq_publisher")


_GROUP = "events for other routers (vLLM's ZMQ wire format)"
# --publish-zmq-hash: vLLM's --prefix-caching-hash-algo values we reproduce, or our own.
PUBLISH_HASHES = (*(a.value for a in VllmHashAlgo), CANONICAL)
_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True, slots=True)
class ZmqPublishConfig:
    """Where and how to republish (the sidecar's ``--publish-zmq*`` flags)."""

    endpoint: str | None = option(
        None, group=_GROUP, flag="--publish-zmq", metavar="ENDPOINT", default_text="off",
        help="also publish the KV events as vLLM does, on a ZMQ PUB socket bound here (e.g. "
        "tcp://*:5557; tcp://HOST:* picks a port, written to the ready file): [topic, seq, "
        "msgpack batch], for vllm-router --policy kv_aware (--kv-event-source), llm-d's "
        "indexer or Dynamo. Worker i of a multi-rank engine binds port+i")
    replay_endpoint: str | None = option(
        None, group=_GROUP, flag="--publish-zmq-replay", metavar="ENDPOINT",
        default_text="none",
        help="a ZMQ ROUTER bound here replays buffered batches from a seq, as vLLM's replay "
        "endpoint does (vllm-router --kv-event-replay-source)")
    topic: str = option(
        "", group=_GROUP, flag="--publish-zmq-topic", default_text="empty",
        help="topic frame of every message (empty is what vLLM sends by default and what "
        "vllm-router's static sources subscribe to)")
    hash_algo: str = option(
        VllmHashAlgo.SHA256_CBOR.value, group=_GROUP, flag="--publish-zmq-hash",
        choices=PUBLISH_HASHES,
        help="the block hashes the consumer expects, recomputed from the events' token ids: "
        "vLLM's sha256_cbor or xxhash_cbor, or canonical (ours, as they are)")
    hash_seed: str = option(
        "0", group=_GROUP, flag="--publish-zmq-hash-seed", metavar="SEED",
        help="the PYTHONHASHSEED a vLLM engine (and so the consumer) hashes with")
    buffer_steps: int = option(
        10_000, group=_GROUP, ge=1, flag="--publish-zmq-buffer-steps", metavar="N",
        help="batches kept for replay (vLLM's default)")

    def __post_init__(self) -> None:
        check_bounds(self)  # each option's range, declared with it; relations follow
        for flag, endpoint in (("--publish-zmq", self.endpoint),
                               ("--publish-zmq-replay", self.replay_endpoint)):
            if endpoint is not None and not endpoint.startswith(_ENDPOINT_SCHEMES):
                raise ValueError(f"{flag} must be a ZMQ endpoint to bind (tcp://HOST:PORT, "
                                 f"tcp://*:PORT, ipc://PATH), got {endpoint!r}")
        if self.replay_endpoint is not None and self.endpoint is None:
            raise ValueError("--publish-zmq-replay serves what --publish-zmq publishes: "
                             "set that too")
        if self.hash_algo not in PUBLISH_HASHES:
            raise ValueError(f"--publish-zmq-hash must be one of {', '.join(PUBLISH_HASHES)}, "
                             f"got {self.hash_algo!r}")


class _Rank:
    """One worker's PUB and replay sockets, sequence and replay buffer."""

    def __init__(
        self,
        rank: int,
        writer: VllmEventWriter,
        pub: zmq.Socket[bytes],
        replay: zmq.asyncio.Socket | None,
        topic: bytes,
        buffer_steps: int,
    ) -> None:
        self.rank = rank
        self.writer = writer
        self.pub = pub
        self.replay = replay
        self.topic = topic
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.pending: list[VlEvent] = []
        self.flush_due = False
        self.batches = 0
        self.replays = 0

    def offer(self, event: KVEvent) -> None:
        """Translate ``event`` now; send it with the rest of this tick's events."""
        self.pending += self.writer.translate(event)
        if self.pending and not self.flush_due:
            self.flush_due = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.flush_due = False
        events, self.pending = self.pending, []
        if not events or self.pub.closed:  # (shutting down: the sockets went first)
            return
        payload = encode_batch(time.time(), events, self.rank)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        self.pub.send_multipart([self.topic, seq_frame(seq), payload], flags=zmq.NOBLOCK)
        self.batches += 1

    async def serve_replay(self) -> None:
        sock = self.replay
        if sock is None:
            return
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("zmq_replay_request_malformed", rank=self.rank, frames=len(frames))
                continue
            client, _, start_frame = frames
            start = int.from_bytes(start_frame, "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await sock.send_multipart([client, b"", seq_frame(seq), payload])
            await sock.send_multipart([client, b"", END_SEQ, b""])
            self.replays += 1


class ZmqRepublisher:
    """Republishes every worker's events; ``run()`` serves replays until cancelled."""

    def __init__(
        self,
        streams: Mapping[str, EventStream],
        cfg: ZmqPublishConfig,
        *,
        model_id: str,
        block_size: int,
    ) -> None:
        if cfg.endpoint is None:
            raise ValueError("ZmqRepublisher needs --publish-zmq")
        self.cfg = cfg
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self._ranks: dict[str, _Rank] = {}
        self._closed = False
        self.endpoints: dict[str, dict[str, str | None]] = {}
        try:
            for rank, (worker_id, stream) in enumerate(streams.items()):
                pub = self._ctx.socket(zmq.PUB)
                pub.setsockopt(zmq.LINGER, 0)
                self._ranks[worker_id] = r = _Rank(
                    rank,
                    VllmEventWriter(model_id, block_size, cfg.hash_algo, cfg.hash_seed),
                    pub,
                    None,
                    cfg.topic.encode("utf-8"),
                    cfg.buffer_steps,
                )
                pub.bind(rank_address(cfg.endpoint, rank))
                bound_replay = None
                if cfg.replay_endpoint is not None:
                    r.replay = self._actx.socket(zmq.ROUTER)
                    r.replay.setsockopt(zmq.LINGER, 0)
                    r.replay.bind(rank_address(cfg.replay_endpoint, rank))
                    bound_replay = _last_endpoint(r.replay)
                self.endpoints[worker_id] = {
                    "endpoint": _last_endpoint(pub),
                    "replay_endpoint": bound_replay,
                    "topic": cfg.topic,
                    "hash": cfg.hash_algo,
                }
                stream.taps.append(r.offer)
        except BaseException:
            self.close()
            raise
        log.info("zmq_publisher_started", workers=self.endpoints)

    async def run(self) -> None:
        """Serve every rank's replay socket until cancelled; then close the sockets."""
        try:
            async with asyncio.TaskGroup() as tasks:
                for r in self._ranks.values():
                    tasks.create_task(r.serve_replay())
        finally:
            self.close()

    def close(self) -> None:
        """Close every socket (again: nothing)."""
        if self._closed:
            return
        self._closed = True
        for r in self._ranks.values():
            r.pub.close(linger=0)
            if r.replay is not None:
                r.replay.close(linger=0)
        self._ctx.term()
        self._actx.term()

    def collect(self) -> Iterator[Metric]:
        """The publisher's counters, for the sidecar's ``/metrics``."""
        p = "kvsidecar_zmq_publish_"
        batches = CounterMetricFamily(p + "batches", "vLLM-format batches published",
                                      labels=["worker"])
        blocks = CounterMetricFamily(p + "blocks", "Blocks republished", labels=["worker"])
        skipped = CounterMetricFamily(
            p + "blocks_skipped", "Blocks not republished, by reason", labels=["worker", "reason"]
        )
        replays = CounterMetricFamily(p + "replays", "Replay requests served", labels=["worker"])
        for worker, r in self._ranks.items():
            batches.add_metric([worker], r.batches)
            blocks.add_metric([worker], r.writer.blocks_published)
            replays.add_metric([worker], r.replays)
            counts: Counter[str] = r.writer.skipped
            for reason, n in counts.items():
                skipped.add_metric([worker, reason], n)
        yield from (batches, blocks, skipped, replays)


def _last_endpoint(sock: zmq.Socket[bytes] | zmq.asyncio.Socket) -> str:
    raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    return raw.decode() if isinstance(raw, bytes) else str(raw)
