"""Shared-memory KV block store: the same-host data plane (docs/architecture.md, "Shared memory").

One owner (the sidecar, or ``python -m shm``) creates a segment and serves a Unix socket;
clients in other processes (engine hooks) attach, ask for slots in batches, and copy block
bytes directly between their arrays and the mapping. A writer holding slots granted ahead
copies while its claim of them is on the way (``BlockStoreClient.begin_put``); once the
store is full, a writer overwrites blocks the owner offered it ahead in the segment, with
no message at all (``shm.owner.store.standby``). Gets of
blocks a client knows the place of need no message at all: they read through the segment's
read index (``shm.read_index``).
"""

from shm.block_names import BlockName, BlockNames
from shm.client._puts import AsyncPendingPut, PendingPut
from shm.client.aio import AsyncBlockStoreClient
from shm.client.blocking import BlockStoreClient
from shm.errors import (
    BlockDtypeError,
    BlockSizeError,
    BlockStoreError,
    ClientDetachedError,
    ForeignSegmentError,
    HeaderCorruptError,
    OwnerConflictError,
    ProtocolError,
    StaleDescriptorError,
    StoreFullError,
    UnknownBlockError,
)
from shm.owner.config import OwnerConfig
from shm.owner.pool import SlotId, SlotPool
from shm.owner.server import BlockStoreOwner, EventListener
from shm.owner.store import BlockKey, BlockStore, StoreStats
from shm.segment import Segment, SegmentHeader, segments_of, unlink_stale_segments

__all__ = [
    "AsyncBlockStoreClient",
    "AsyncPendingPut",
    "BlockDtypeError",
    "BlockKey",
    "BlockName",
    "BlockNames",
    "BlockSizeError",
    "BlockStore",
    "BlockStoreClient",
    "BlockStoreError",
    "BlockStoreOwner",
    "ClientDetachedError",
    "EventListener",
    "ForeignSegmentError",
    "HeaderCorruptError",
    "OwnerConfig",
    "OwnerConflictError",
    "PendingPut",
    "ProtocolError",
    "Segment",
    "SegmentHeader",
    "SlotId",
    "SlotPool",
    "StaleDescriptorError",
    "StoreFullError",
    "StoreStats",
    "UnknownBlockError",
    "segments_of",
    "unlink_stale_segments",
]
