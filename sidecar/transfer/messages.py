"""What importer and exporter say to each other over HTTP (msgspec JSON; never payload).

A NIXL or TCP pull is: the importer reserves room in its own store, then
``POST /v1/blocks/export``
with an ``ExportRequest``; the exporter leases the blocks and answers an ``ExportOffer``
(where they are: slots and generations, and how to reach them for the chosen transport).
The importer moves the bytes by that transport and commits them only if the lease held
throughout: the copy ended before the lease's deadline (``ttl_s``, counted by the importer
from before its request), or the TCP stream completed. It then gives the export back with
``POST /v1/blocks/exports/{export_id}/release`` (a TCP export ends with its stream).

A same-host (shm) pull needs no HTTP per batch: the importer reads ``PeerInfo.socket`` once
and leases through the exporter's block store socket (``shm_transport``).

What starts a pull (the gateway, handing a request's prefix from a prefill worker to a decode
worker) sends the importer ``POST /v1/blocks/pull`` with a ``PullRequest``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, TypeVar

import msgspec
from msgspec import Meta

from sidecar.transfer.errors import BadTransferRequestError

__all__ = [
    "BlockKey",
    "ExportOffer",
    "ExportRequest",
    "NamedKeys",
    "NamedKeysRequest",
    "NixlPeerInfo",
    "PeerInfo",
    "PullRequest",
    "PullResult",
    "ReleaseReply",
    "Transport",
    "check_keys",
    "decode",
    "encode",
]

U64 = Annotated[int, Meta(ge=0)]  # the upper bound is checked after decoding
T = TypeVar("T")
U64_MAX = (1 << 64) - 1
BlockKey = tuple[int, int]
"""``(namespace_seed, block_hash)``, as in the block store."""


class Transport(enum.StrEnum):
    """How block bytes move from the exporter's store to the importer's."""

    SHM = "shm"  # same host: lease via the peer's store socket, copy from a read-only map
    NIXL = "nixl"  # NIXL (UCX) READ from the exporter's registered memory
    TCP = "tcp"  # a plain socket stream, received straight into the reserved slots


class ExportRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Lease these blocks for me and say where they are."""

    keys: list[tuple[U64, U64]]
    transport: Transport
    block_bytes: Annotated[int, Meta(ge=1)]
    dtype: str
    ttl_s: Annotated[float, Meta(gt=0)]


class ExportOffer(msgspec.Struct, frozen=True):
    """The leased blocks, in request order, and the way to fetch them."""

    export_id: str
    owner_id: str
    transport: Transport
    block_bytes: int
    slot_bytes: int
    dtype: str
    slots: list[int]
    generations: list[int]
    ttl_s: float
    tcp_host: str | None = None  # tcp: where to connect
    tcp_port: int | None = None
    nixl_agent: str | None = None  # nixl: the agent that registered the segment


class ReleaseReply(msgspec.Struct, frozen=True):
    """The export's leases were held until now: the bytes read are the committed ones."""

    export_id: str
    num_blocks: int


class NixlPeerInfo(msgspec.Struct, frozen=True):
    """What a NIXL importer needs once per exporter (``GET /v1/blocks/nixl``)."""

    agent: str
    metadata_b64: str  # the agent's metadata, for ``add_remote_agent``
    base_address: int  # slot 0's address in the exporter's registered region
    slot_bytes: int
    num_slots: int


class PeerInfo(msgspec.Struct, frozen=True):
    """A transfer service's self-description (``GET /v1/blocks/info``)."""

    owner_id: str
    block_bytes: int
    dtype: str
    transports: list[Transport]
    tcp_port: int | None
    socket: str  # the block store's control socket: same-host peers lease through it
    segment: str  # the store's shared-memory segment


class PullRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Pull these blocks from ``peer_url`` into this sidecar's store.

    ``transport`` defaults to shm, ``timeout_s`` to the service's ``pull_timeout_s``.
    """

    peer_url: str
    keys: list[tuple[int, int]]
    transport: Transport = Transport.SHM
    timeout_s: float | None = None


class NamedKeysRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which of these blocks, named canonically (a prefix's chained hashes, in order), does
    your store hold, and under which keys (``POST /v1/blocks/named``)? A peer that moves a
    prefix knows it by the gateway's hashes; the store may key it by the engine's."""

    block_hashes: list[U64]


class NamedKeys(msgspec.Struct, frozen=True):
    """The store keys of the leading blocks held, up to the first one not held."""

    keys: list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class PullResult:
    """A finished pull: every key is either imported now or was already held."""

    transport: Transport
    imported: tuple[BlockKey, ...]
    already_held: tuple[BlockKey, ...]
    num_bytes: int
    seconds: float

    @property
    def gbytes_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def check_keys(keys: Sequence[BlockKey], limit: int) -> list[BlockKey]:
    """``keys`` as a list of checked ``(u64, u64)`` pairs, or ``BadTransferRequestError``."""
    if not keys:
        raise BadTransferRequestError("a pull needs at least one key")
    if len(keys) > limit:
        raise BadTransferRequestError(f"{len(keys)} keys; at most {limit} per pull")
    checked: list[BlockKey] = []
    for key in keys:
        try:
            ns, block_hash = key
        except (TypeError, ValueError) as exc:
            raise BadTransferRequestError(
                f"key {key!r} is not a (namespace_seed, block_hash) pair") from exc
        if not (isinstance(ns, int) and isinstance(block_hash, int)
                and 0 <= ns <= U64_MAX and 0 <= block_hash <= U64_MAX):
            raise BadTransferRequestError(f"key {key!r} is not two unsigned 64-bit integers")
        checked.append((ns, block_hash))
    return checked


_encoder = msgspec.json.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode(raw: bytes, kind: type[T]) -> T:
    """``raw`` as a ``kind``, or ``BadTransferRequestError`` saying what is wrong."""
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError as exc:
        raise BadTransferRequestError(f"bad {kind.__name__}: {exc}") from exc
