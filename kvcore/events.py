"""Normalized KV events and snapshots: what every adapter produces and every index consumes.

Each event names the worker (one engine replica, or one data-parallel rank of it), the
worker's *epoch* (a new one each time the engine restarts and its cache starts empty) and a
per-worker *sequence number* that grows by one per event inside an epoch, starting at 1.
A consumer that sees a gap (or a new epoch mid-stream) resyncs from a ``WorkerSnapshot``
taken at some sequence number ``seq``: the state after applying events ``1..seq``.

Producers (the engine adapters, the block store) emit events *unstamped*: epoch and seq are
``UNSTAMPED`` (0). The sidecar's event relay is the one place that stamps them, with its
epoch and the next sequence number, before they leave the process. A producer that no
longer knows what its worker holds says so explicitly with ``AllBlocksCleared``.

Block hashes are canonical (``hashing.py``): chained, so holding block ``i`` of a request
means the worker once stored blocks ``0..i-1`` under the same namespace. ``token_ids`` of a
stored event are optional (a relay may strip them); when present there are exactly
``block_size`` per block, flattened.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec
from msgspec import Meta

__all__ = [
    "U64",
    "UNSTAMPED",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Counter",
    "IndexSnapshot",
    "KVEvent",
    "Tier",
    "TierBlocks",
    "WorkerId",
    "WorkerSnapshot",
]

# msgpack integers stop at 2**64 - 1, so only the lower bound needs checking on decode.
U64 = Annotated[int, Meta(ge=0)]
U32 = Annotated[int, Meta(ge=0, le=(1 << 32) - 1)]
Counter = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
WorkerId = Annotated[str, Meta(min_length=1, max_length=256)]
UNSTAMPED = 0  # the epoch and seq of an event no relay has stamped yet


class Tier(enum.IntEnum):
    """Where a worker holds a block, fastest first."""

    GPU = 0
    HOST = 1
    DISK = 2
    REMOTE = 3


class BlockStored(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=1):
    """A chain of blocks now held in ``tier``; the first one hangs under ``parent_hash``."""

    worker_id: WorkerId
    epoch: Counter
    seq: Counter
    tier: Tier
    block_hashes: Annotated[list[U64], Meta(min_length=1)]
    parent_hash: U64 | None = None
    token_ids: list[U32] | None = None

    def __post_init__(self) -> None:
        if self.token_ids is not None and len(self.token_ids) % len(self.block_hashes):
            raise ValueError(
                f"token_ids holds {len(self.token_ids)} ids, not a multiple of "
                f"{len(self.block_hashes)} blocks"
            )


class BlockRemoved(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=2):
    """These blocks left ``tier`` (evicted or freed)."""

    worker_id: WorkerId
    epoch: Counter
    seq: Counter
    tier: Tier
    block_hashes: Annotated[list[U64], Meta(min_length=1)]


class AllBlocksCleared(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=3):
    """Every block of the worker in ``tier`` is gone (a cache flush)."""

    worker_id: WorkerId
    epoch: Counter
    seq: Counter
    tier: Tier


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class TierBlocks(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Every block a worker holds in one tier, each with its parent (None: a first block)
    and, when the holder kept them, its token ids.

    ``token_ids`` is empty (no tokens at all: an older peer, an index that keeps none) or
    one entry per block: its token ids as little-endian u32, ``b""`` for a block whose
    events carried none. Bytes, not ints: a snapshot of a million blocks carries 16 M token
    ids, which msgpack moves as one copy per block instead of one object per id. It was
    appended within wire version 2: an older subscriber ignores it, an older sidecar's
    snapshot decodes it as empty.
    """

    tier: Tier
    block_hashes: list[U64]
    parent_hashes: list[U64 | None]
    token_ids: list[bytes] = []

    def __post_init__(self) -> None:
        if len(self.block_hashes) != len(self.parent_hashes):
            raise ValueError(
                f"{len(self.block_hashes)} block hashes but {len(self.parent_hashes)} parents"
            )
        if self.token_ids:
            if len(self.token_ids) != len(self.block_hashes):
                raise ValueError(f"{len(self.block_hashes)} block hashes but token ids for "
                                 f"{len(self.token_ids)} blocks")
            for raw in self.token_ids:
                if len(raw) % 4:
                    raise ValueError(f"a block's token ids are u32: {len(raw)} bytes is not "
                                     "a multiple of 4")


class WorkerSnapshot(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=4):
    """A worker's whole cache after event ``seq`` of ``epoch``."""

    worker_id: WorkerId
    epoch: Counter
    seq: Counter
    tiers: list[TierBlocks]


class IndexSnapshot(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=5):
    """A prefix index's whole state: one snapshot per worker, and which of them had a gap
    in their stream (their state may be incomplete until a resync)."""

    workers: list[WorkerSnapshot]
    needs_resync: list[WorkerId] = []
