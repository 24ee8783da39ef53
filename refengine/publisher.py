"""SGLang's KV-event publisher on ZMQ: a PUB socket for the live stream and a ROUTER socket
for replay (``ZmqEventPublisher`` in ``sglang/srt/disaggregation/kv_events.py``).

Live message: ``[topic, seq (8 bytes big-endian), msgpack([ts, events, dp_rank])]``, seq from
0 per process. Replay: a DEALER sends ``[b"", start_seq]``; the ROUTER answers every buffered
batch with seq >= start as ``[id, b"", topic, seq, payload]`` and ends with
``[id, b"", b"", 0xff×8, b""]``. Requests of any other shape are ignored (and counted).

Ports: an endpoint is bound when it contains ``*``, ``::``, ``0.0.0.0``, ``ipc://`` or
``inproc://`` (or ``bind: true``), connected otherwise, as in SGLang. Port ``0`` or ``*``
binds an ephemeral port; :meth:`describe` advertises the port actually bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from refengine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from refengine.kv_events import KVEventsConfig as _Cfg

__all__ = ["END_SEQ", "KVEventPublisher", "offset_endpoint_port"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
log = structlog.get_logger(component="kv_events")


def offset_endpoint_port(endpoint: str | None, rank: int) -> str | None:
    """SGLang's per-rank rule: rank ``r`` uses ``port + r`` (ephemeral ports stay ephemeral)."""
    if not endpoint or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if port in ("*", "0"):
        return endpoint
    return f"{base}:{int(port) + rank}"


def _zmq_endpoint(endpoint: str) -> str:
    # libzmq spells an ephemeral TCP port "*"; accept ":0" too.
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint


def _should_bind(cfg: _Cfg, endpoint: str) -> bool:
    if cfg.bind is not None:
        return cfg.bind
    return (
        "*" in endpoint
        or "::" in endpoint
        or "0.0.0.0" in endpoint
        or endpoint.startswith(("ipc://", "inproc://"))
    )


def _split_tcp(endpoint: str | None) -> tuple[str, int] | None:
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    try:
        return host, int(port)
    except ValueError:
        return None


class KVEventPublisher:
    """Async context manager owning the PUB and ROUTER sockets and the replay buffer."""

    def __init__(self, cfg: _Cfg, replica: int = 0) -> None:
        """``replica`` offsets fixed ports (SGLang's per-DP-rank rule) when one process serves
        several replicas; each replica is its own server, so batches carry dp rank 0."""
        self.cfg = cfg
        self.dp_rank = 0
        self.endpoint = offset_endpoint_port(cfg.endpoint, replica) or cfg.endpoint
        self.replay_endpoint = offset_endpoint_port(cfg.replay_endpoint, replica)
        self._topic = cfg.topic.encode("utf-8")
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.bound_endpoint: str | None = None
        self.bound_replay_endpoint: str | None = None
        self.replay_requests_invalid = 0
        self.published_batches = 0

    async def __aenter__(self) -> KVEventPublisher:
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(self.cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if _should_bind(self.cfg, self.endpoint):
            self._pub.bind(_zmq_endpoint(self.endpoint))
            self.bound_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(self.endpoint)
        if self.replay_endpoint is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(_zmq_endpoint(self.replay_endpoint))
            self.bound_replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())
        log.info(
            "kv_event_publisher_started",
            endpoint=self.bound_endpoint or self.endpoint,
            replay_endpoint=self.bound_replay_endpoint,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()

    def publish(self, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> int:
        """Send one batch (one scheduler step's events); returns its sequence number."""
        if self._pub is None:
            raise RuntimeError("publisher is not started")
        seq = self._seq
        self._seq += 1
        payload = self._encoder.encode(KVEventBatch(time.time(), events, self.dp_rank))
        # A PUB socket never blocks: past the HWM ZMQ drops, which replay then repairs.
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        self._buffer.append((seq, payload))
        self.published_batches += 1
        return seq

    async def _serve_replay(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                self.replay_requests_invalid += 1
                log.warning("kv_replay_request_rejected", frames=len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._router.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            await self._router.send_multipart((client, b"", b"", END_SEQ, b""))

    def describe(self, block_size: int) -> dict[str, Any] | None:
        """The ``kv_events`` block of ``/server_info`` (``describe_kv_events_publisher``),
        with the ports actually bound."""
        resolved = _split_tcp(self.bound_endpoint or self.endpoint)
        if resolved is None:
            return None
        configured = _split_tcp(self.endpoint)
        host = configured[0] if configured else resolved[0]
        out: dict[str, Any] = {
            "publisher": self.cfg.publisher,
            "endpoint_host": host,
            "endpoint_port_base": resolved[1],
            "topic": self.cfg.topic,
            "block_size": block_size,
            "dp_size": 1,
        }
        replay = _split_tcp(self.bound_replay_endpoint or self.replay_endpoint)
        if replay is not None:
            out["replay_endpoint_port_base"] = replay[1]
        return out
