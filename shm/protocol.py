"""The control channel's messages and framing (never block payloads, never pickle).

A frame is a little-endian u32 body length followed by a msgpack body, decoded by msgspec
into one of the tagged structs below. Keys travel as two flat lists (namespace seeds and
block hashes), slot descriptors as two flat lists (slots and generations), so a batch of
64 blocks is one frame of about a kilobyte and one decode.

Every request gets exactly one reply, in order, except the one-way messages ``Release``
and ``Publish`` (a commit), which get none: a reader gives its leases back, and a writer
that does not read optimistically makes its blocks visible, without waiting (one that does
commits with no message at all, by publishing its slots in the read index: see
``shm.read_index``; no writer waits for its commit). A connection's replies therefore pair
with its requests first-in first-out, with no request ids. The owner records what writers
have published, and handles every one-way frame that has reached it, before any request
it reads in the same wake-up (see ``shm.owner.server``), so a block ``put_many`` has returned is
visible to any request sent after that, on any connection.
"""

from __future__ import annotations

import struct
from typing import Annotated

import msgspec
from msgspec import Meta

from shm.errors import ProtocolError
from shm.owner.store import StoreStats

__all__ = [
    "ONE_WAY_TAGS",
    "PROTOCOL_VERSION",
    "Abort",
    "Claim",
    "Contains",
    "Done",
    "ErrorReply",
    "Flags",
    "FrameReader",
    "Hello",
    "Lease",
    "Ping",
    "Publish",
    "Release",
    "Remove",
    "Reply",
    "Request",
    "Reserve",
    "Slots",
    "Stats",
    "StatsReply",
    "Welcome",
    "decode_reply",
    "decode_request",
    "encode",
    "frame_length",
    "is_one_way",
]

# 2: Publish; 3: the read index, Welcome.hit_cell; 4: grants, Claim; 5: a writer's
# publication of its reserved slots in the read index commits them; 6: no Commit (every
# client commits by publication, or Publish), StatsReply carries StoreStats by name;
# 7: standby grants, offered and overwritten through the read index (no message).
PROTOCOL_VERSION = 7
MAX_FRAME_BYTES = 16 << 20
_LENGTH = struct.Struct("<I")

# msgpack integers stop at 2**64 - 1, so only the lower bound needs checking.
U64 = Annotated[int, Meta(ge=0)]
U32 = Annotated[int, Meta(ge=0, le=(1 << 32) - 1)]


class _Msg(msgspec.Struct, frozen=True, array_like=True, gc=False):
    pass


# ------------------------------------------------------------------- requests
class Hello(_Msg, frozen=True, array_like=True, gc=False, tag=1):
    """First message of a connection."""

    protocol_version: int
    client_pid: int


class Reserve(_Msg, frozen=True, array_like=True, gc=False, tag=2):
    """Slots to write for these keys; ``parents``/``tokens`` complete the stored event.

    ``grant``: also top this client's write-ahead grant up to that many slots (see
    ``Claim``); the reply's ``grant_slots`` lists what was added. ``standby``: the client
    can overwrite a standby grant (``shm.owner.store.standby``), which the owner offers it in the
    read index if this reserve leaves the store full."""

    namespaces: list[U64]
    hashes: list[U64]
    parents: list[U64 | None] | None = None
    tokens: list[list[U32] | None] | None = None
    grant: Annotated[int, Meta(ge=0, le=1 << 20)] = 0
    standby: bool = False


class Claim(_Msg, frozen=True, array_like=True, gc=False, tag=12):
    """``Reserve`` for slots the owner granted ahead: key ``i`` takes granted slot ``i``.

    A client sends it, then copies into the slots while the owner handles it, then reads
    the ``Slots`` reply: keys that got no slot (held, or in flight) leave theirs granted,
    listed again in ``grant_slots`` with the top-up ``grant`` asks for."""

    namespaces: list[U64]
    hashes: list[U64]
    slots: list[int]
    generations: list[int]
    parents: list[U64 | None] | None = None
    tokens: list[list[U32] | None] | None = None
    grant: Annotated[int, Meta(ge=0, le=1 << 20)] = 0


class Publish(_Msg, frozen=True, array_like=True, gc=False, tag=11):
    """Commit reserved slots, with no reply: what a put sends once its copy is done if the
    client does not read optimistically (one that does commits by publishing its slots in
    the read index instead: see ``shm.read_index``). Tag 3, a commit with a reply, is gone
    since protocol 6."""

    slots: list[int]
    generations: list[int]


class Abort(_Msg, frozen=True, array_like=True, gc=False, tag=4):
    slots: list[int]
    generations: list[int]


class Lease(_Msg, frozen=True, array_like=True, gc=False, tag=5):
    namespaces: list[U64]
    hashes: list[U64]


class Release(_Msg, frozen=True, array_like=True, gc=False, tag=6):
    """Give leases back. The owner sends no reply."""

    slots: list[int]
    generations: list[int]


class Contains(_Msg, frozen=True, array_like=True, gc=False, tag=7):
    namespaces: list[U64]
    hashes: list[U64]


class Remove(_Msg, frozen=True, array_like=True, gc=False, tag=8):
    namespaces: list[U64]
    hashes: list[U64]


class Stats(_Msg, frozen=True, array_like=True, gc=False, tag=9):
    pass


class Ping(_Msg, frozen=True, array_like=True, gc=False, tag=10):
    pass


Request = (
    Hello | Reserve | Claim | Publish | Abort | Lease | Release | Contains | Remove | Stats
    | Ping
)
ONE_WAY_TAGS = frozenset({Release.__struct_config__.tag, Publish.__struct_config__.tag})


# -------------------------------------------------------------------- replies
class Welcome(_Msg, frozen=True, array_like=True, gc=False, tag=101):
    """What a client needs to attach: the segment and its block format."""

    protocol_version: int
    owner_id: str
    worker_id: str
    epoch: int
    segment: str
    block_bytes: int
    num_slots: int
    dtype: str
    layout: str
    hit_cell: int = -1  # this client's cell in the read index's hit counters; -1: none


class Slots(_Msg, frozen=True, array_like=True, gc=False, tag=102):
    """One descriptor per key; ``None`` in both lists where the key gets no slot.

    ``grant_slots``/``grant_generations``: slots newly granted to the client ahead of its
    next put (replies to ``Reserve`` and ``Claim`` only)."""

    slots: list[int | None]
    generations: list[int | None]
    grant_slots: list[int] = []
    grant_generations: list[int] = []


class Flags(_Msg, frozen=True, array_like=True, gc=False, tag=103):
    values: list[bool]


class Done(_Msg, frozen=True, array_like=True, gc=False, tag=104):
    pass


class StatsReply(_Msg, frozen=True, array_like=True, gc=False, tag=105):
    """The store's statistics, as the owner reports them (a map of ``StoreStats`` fields)."""

    stats: StoreStats


class ErrorReply(_Msg, frozen=True, array_like=True, gc=False, tag=106):
    """A request failed; ``code`` names the error class (``shm.errors``)."""

    code: str
    message: str


Reply = Welcome | Slots | Flags | Done | StatsReply | ErrorReply

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(message: _Msg) -> bytes:
    """One length-prefixed frame."""
    body = _encoder.encode(message)
    return _LENGTH.pack(len(body)) + body


def decode_request(body: bytes | memoryview) -> Request:
    try:
        return _request_decoder.decode(body)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise ProtocolError(f"bad control request ({len(body)} bytes): {exc}") from exc


def decode_reply(body: bytes | memoryview) -> Reply:
    try:
        return _reply_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad control reply ({len(body)} bytes): {exc}") from exc


def is_one_way(body: bytes) -> bool:
    """Whether a frame body is tagged ``Release`` or ``Publish`` (``ONE_WAY_TAGS``): a
    msgpack array, then its tag. The owner reads it without decoding the frame."""
    return len(body) > 1 and 0x90 <= body[0] <= 0x9F and body[1] in ONE_WAY_TAGS


def frame_length(buf: bytes | bytearray, pos: int = 0) -> int:
    """The body length announced by the 4-byte prefix at ``pos``, checked against the limit."""
    length: int = _LENGTH.unpack_from(buf, pos)[0]
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES} byte limit")
    return length


class FrameReader:
    """Splits a byte stream into frame bodies."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        bodies: list[bytes] = []
        pos = 0
        while len(buf) - pos >= 4:
            length = frame_length(buf, pos)
            if len(buf) - pos - 4 < length:
                break
            bodies.append(bytes(buf[pos + 4 : pos + 4 + length]))
            pos += 4 + length
        if pos:
            del buf[:pos]
        return bodies
