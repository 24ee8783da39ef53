"""The versioned binary wire codec for events and snapshots (msgspec msgpack).

A frame is one version byte followed by one msgpack message; ``decode`` turns anything that
is not a valid frame into ``WireError`` naming what was wrong, never another exception.
"""

from __future__ import annotations

import msgspec

from kvcore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    IndexSnapshot,
    WorkerSnapshot,
)
from kvcore.stream import ResyncRequired, StreamStart, WorkerStatus

__all__ = ["WIRE_VERSION", "Message", "WireError", "decode", "encode"]

WIRE_VERSION = 2  # 2: WorkerStatus (routability, capacity) replaced LoadReport

Message = (
    BlockStored
    | BlockRemoved
    | AllBlocksCleared
    | WorkerSnapshot
    | IndexSnapshot
    | StreamStart
    | WorkerStatus
    | ResyncRequired
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_HEAD_BYTES = 32


class WireError(ValueError):
    """Bytes that are not a valid kvsidecar frame; the message says why."""


def encode(message: Message) -> bytes:
    """One frame: the version byte, then the message as msgpack."""
    buf = bytearray(b"\x00")
    buf[0] = WIRE_VERSION
    _encoder.encode_into(message, buf, 1)
    return bytes(buf)


def decode(frame: bytes | bytearray | memoryview) -> Message:
    """The message in ``frame``; raises ``WireError`` on anything else."""
    view = memoryview(frame)
    if len(view) < 2:
        raise WireError(f"frame of {len(view)} bytes is too short (version byte + message)")
    if view[0] != WIRE_VERSION:
        raise WireError(
            f"unsupported wire version {view[0]}, expected {WIRE_VERSION} "
            f"(head: {bytes(view[:_HEAD_BYTES]).hex()})"
        )
    try:
        return _decoder.decode(view[1:])
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError) as exc:
        raise WireError(
            f"invalid kvsidecar message: {exc} (head: {bytes(view[:_HEAD_BYTES]).hex()})"
        ) from exc
