"""The versioned binary wire codec for events and snapshots (msgspec msgpack).

A frame is one version byte followed by one msgpack message; ``decode`` turns anything that
is not a valid frame into ``WireError`` naming what was wrong, never another exception.
Frames travel in batches, each prefixed by its 4-byte big-endian length (``join_frames``,
``split_frames``): the sidecar's event stream body, a JetStream message of events.

Columns of unsigned ints travel as raw little-endian bytes (``pack_le``, ``unpack_le``):
token ids as u32 (a snapshot's per-block ids, the XXH3 rolling hashes' input), block hashes
as u64 (an index image). One place knows the host's byte order.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable

import msgspec

from kvcore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    IndexSnapshot,
    WorkerSnapshot,
)
from kvcore.stream import ResyncRequired, StreamStart, WorkerStatus

__all__ = [
    "FRAME_HEADER",
    "WIRE_VERSION",
    "Message",
    "WireError",
    "decode",
    "encode",
    "join_frames",
    "pack_le",
    "split_frames",
    "unpack_le",
]

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
FRAME_HEADER = struct.Struct(">I")  # a frame's length, before it in a batch
_BIG_ENDIAN_HOST = sys.byteorder == "big"
# array type codes by width in bytes: "I" is 4 bytes on every platform CPython runs on, "L"
# where it is not; "Q" is 8
_UINT_CODES = {4: "I" if array("I").itemsize == 4 else "L", 8: "Q"}


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


def join_frames(frames: list[bytes]) -> bytes:
    """Frames as one batch, each after its length."""
    out = bytearray()
    pack = FRAME_HEADER.pack
    for frame in frames:
        out += pack(len(frame))
        out += frame
    return bytes(out)


def split_frames(batch: bytes | bytearray | memoryview) -> list[memoryview]:
    """The frames of a batch (undecoded); raises ``WireError`` if it does not split exactly."""
    view = memoryview(batch)
    frames = []
    pos, end, size = 0, len(view), FRAME_HEADER.size
    unpack = FRAME_HEADER.unpack_from
    while pos < end:
        if end - pos < size:
            raise WireError(f"batch ends inside a frame header at byte {pos} of {end}")
        (length,) = unpack(view, pos)
        pos += size
        if length > end - pos:
            raise WireError(f"frame of {length} bytes at byte {pos} overruns a batch of {end}")
        frames.append(view[pos : pos + length])
        pos += length
    return frames


def _uint_code(width: int) -> str:
    code = _UINT_CODES.get(width)
    if code is None:
        raise ValueError(f"unsigned ints are {sorted(_UINT_CODES)} bytes wide, not {width}")
    return code


def pack_le(values: Iterable[int], width: int = 4) -> bytes:
    """``values`` as little-endian unsigned ints of ``width`` bytes (4: token ids, 8: block
    hashes); ``WireError`` names the first value that does not fit."""
    column = array(_uint_code(width))
    items = values if isinstance(values, list) else list(values)
    try:
        column.fromlist(items)  # the fastest packing: one C pass
    except (OverflowError, TypeError):
        bad = next((v for v in items if not (isinstance(v, int) and 0 <= v < 1 << 8 * width)),
                   None)
        raise WireError(f"{bad!r} is not an unsigned {8 * width}-bit int") from None
    if _BIG_ENDIAN_HOST:
        column.byteswap()
    return column.tobytes()


def unpack_le(raw: bytes | bytearray | memoryview, width: int = 4,
              what: str = "column") -> list[int]:
    """The unsigned ints of ``width`` bytes that ``pack_le`` wrote into ``raw``; ``WireError``
    (naming ``what``) if its length is not a multiple of ``width``."""
    column = array(_uint_code(width))
    size = raw.nbytes if isinstance(raw, memoryview) else len(raw)
    if size % width:
        raise WireError(f"{what} holds {size} bytes, not a multiple of {width} "
                        f"(u{8 * width} little-endian)")
    column.frombytes(raw)
    if _BIG_ENDIAN_HOST:
        column.byteswap()
    return column.tolist()
