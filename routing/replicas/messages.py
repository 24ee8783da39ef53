"""What gateway replicas tell each other: placements and their lifecycle, batched per tick.

A frame is one version byte and one msgpack ``ReplicaBatch`` (msgspec, array-like structs:
no field names on the wire), as ``kvcore.wire`` frames events. Every batch carries its
replica's id and a per-replica ``seq`` so a receiver sees a gap and asks for a snapshot
(``ResyncRequest``); a batch with ``snapshot`` set lists every request the replica has in
flight and replaces what the receiver knew of it. An empty batch is a heartbeat. A
``ClaimRequest`` asks a new prompt's owner to place it; the owner answers with ``Claimed`` in
its next batch (routing/replicas/prompt_hold.py).

Version 2 (``Claimed``, ``ClaimRequest``): a replica of version 1 rejects these frames and
logs ``replica_batch_rejected``; replicas of one fleet are upgraded together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, TypeVar

import msgspec

from kvcore.wire import WireError

__all__ = [
    "REPLICA_WIRE_VERSION",
    "AskedPrompt",
    "ClaimRequest",
    "Claimed",
    "Finished",
    "FirstToken",
    "Placed",
    "ReplicaBatch",
    "ReplicaEvent",
    "ResyncRequest",
    "decode_batch",
    "decode_claim",
    "decode_resync",
    "encode",
]

REPLICA_WIRE_VERSION = 2

T = TypeVar("T")
_Count = Annotated[int, msgspec.Meta(ge=0)]


class Placed(msgspec.Struct, frozen=True, array_like=True, tag=0):
    """A request (leg) dispatched to ``worker_id``: its prompt blocks and uncached tokens."""

    key: str
    worker_id: str
    block_hashes: Sequence[int]
    prompt_tokens: _Count
    prefill_tokens: _Count  # uncached prompt tokens, loading the worker until the first token


class FirstToken(msgspec.Struct, frozen=True, array_like=True, tag=1):
    """The request's prefill is done."""

    key: str


class Finished(msgspec.Struct, frozen=True, array_like=True, tag=2):
    """The request ended (finished, failed or aborted)."""

    key: str


class Claimed(msgspec.Struct, frozen=True, array_like=True, tag=3):
    """The owner of a new prompt chose ``worker_id`` for it, asked by a peer that holds a
    session of it (``ClaimRequest``): the prompt is predicted there, with no load."""

    worker_id: str
    block_hashes: Sequence[int]


ReplicaEvent = Placed | FirstToken | Finished | Claimed


class ReplicaBatch(msgspec.Struct, frozen=True, array_like=True):
    """One replica's events of one event-loop tick, in order."""

    replica_id: str
    seq: _Count
    snapshot: bool
    events: list[ReplicaEvent]


class ResyncRequest(msgspec.Struct, frozen=True, array_like=True):
    """Asks ``replica_id`` to publish a snapshot (a receiver missed some of its batches)."""

    replica_id: str


class AskedPrompt(msgspec.Struct, frozen=True, array_like=True):
    """A new prompt held for its owner: its blocks, the workers it may go to, and the one
    the asker would place it on."""

    block_hashes: Sequence[int]
    worker_ids: Sequence[str]
    proposed: str


class ClaimRequest(msgspec.Struct, frozen=True, array_like=True):
    """Asks ``replica_id``, the owner of each of ``prompts``, to place them (``Claimed``):
    the asker holds a session of each (routing/replicas/prompt_hold.py)."""

    replica_id: str
    prompts: list[AskedPrompt]


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(ReplicaBatch)
_resync_decoder = msgspec.msgpack.Decoder(ResyncRequest)
_claim_decoder = msgspec.msgpack.Decoder(ClaimRequest)


def encode(message: ReplicaBatch | ResyncRequest | ClaimRequest) -> bytes:
    """One frame: the version byte, then the message as msgpack."""
    buf = bytearray(b"\x00")
    buf[0] = REPLICA_WIRE_VERSION
    _encoder.encode_into(message, buf, 1)
    return bytes(buf)


def decode_batch(frame: bytes) -> ReplicaBatch:
    """The batch in ``frame``; ``WireError`` on anything else."""
    return _decode(frame, _batch_decoder)


def decode_resync(frame: bytes) -> ResyncRequest:
    """The resync request in ``frame``; ``WireError`` on anything else."""
    return _decode(frame, _resync_decoder)


def decode_claim(frame: bytes) -> ClaimRequest:
    """The claim request in ``frame``; ``WireError`` on anything else."""
    return _decode(frame, _claim_decoder)


def _decode(frame: bytes, decoder: msgspec.msgpack.Decoder[T]) -> T:
    if len(frame) < 2:
        raise WireError(f"replica frame of {len(frame)} bytes is too short")
    if frame[0] != REPLICA_WIRE_VERSION:
        raise WireError(
            f"unsupported replica wire version {frame[0]}, expected {REPLICA_WIRE_VERSION}"
        )
    try:
        return decoder.decode(memoryview(frame)[1:])
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError) as exc:
        raise WireError(f"invalid replica message: {exc} (head: {frame[:32].hex()})") from exc
