"""An in-process store session: the embedding process's own reads and writes, no socket.

The sidecar runs ``BlockStoreOwner`` in its event loop. Its block transfer service reads
and writes blocks of that same store, so it needs what a client has (reserve, commit,
abort, lease, release, each with the owner's checks and host-tier events) without a Unix
socket or a second mapping: ``LocalSession`` sends the same control messages straight to
``BlockStoreOwner.handle`` (its commit, which no client sends as a message, is a call:
``BlockStoreOwner.commit``) and hands out views of the owner's own mapping. That matters
for transports that register memory (NIXL): the addresses are the owner's.

Call it from the owner's event loop thread only (the store core is not thread-safe); the
views may be filled or read in a worker thread while the slots are reserved or leased.
``close()`` frees what the session still holds, as a client's disconnect does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

import shm.client._requests as req
from shm.client._transport import expect
from shm.errors import ClientDetachedError
from shm.owner.server import BlockStoreOwner
from shm.owner.store import BlockKey, SessionId
from shm.protocol import (
    Abort,
    Done,
    Flags,
    Release,
    Reserve,
    Slots,
    decode_reply,
    encode,
)

__all__ = ["LocalSession"]

R = TypeVar("R")


class LocalSession:
    """One store session of the owner's own process; ``close()`` (or ``with``) ends it."""

    def __init__(self, owner: BlockStoreOwner) -> None:
        if owner.store is None or owner.segment is None:
            raise ClientDetachedError("the block store owner is not running")
        self._owner = owner
        self._session: SessionId | None = owner.store.open_session()
        header = owner.segment.header
        self.block_bytes = header.block_bytes
        self.slot_bytes = header.slot_bytes
        self.dtype = header.dtype
        self.num_slots = header.num_slots
        # (num_slots, block_bytes) uint8 rows of the owner's mapping.
        self.rows: np.ndarray = owner.segment.slots[:, : header.block_bytes]

    @property
    def base_address(self) -> int:
        """Address of slot 0 in this process (slot ``i`` is at ``base + i * slot_bytes``)."""
        return int(self.rows.ctypes.data)

    def _call(self, request: Any, kind: type[R]) -> R:
        if self._session is None:
            raise ClientDetachedError("the local session is closed")
        frame = self._owner.handle(self._session, encode(request)[4:])  # no deferred reply
        if not isinstance(frame, bytes):
            raise ClientDetachedError("the owner sent no reply")
        return expect(decode_reply(frame[4:]), kind)

    def reserve(
        self,
        keys: Sequence[BlockKey],
        parent_hashes: req.Parents = None,
        token_ids: req.Tokens = None,
    ) -> Slots:
        """Slots to fill per key (``None`` where held or in flight); ``StoreFullError``."""
        return self._call(
            Reserve(*req.split_keys(keys),
                    None if parent_hashes is None else list(parent_hashes),
                    None if token_ids is None else list(token_ids)),
            Slots,
        )

    def commit(self, slots: list[int], generations: list[int]) -> None:
        """Make reserved slots visible, their bytes in: no frame, but the owner's checks
        (``StaleDescriptorError``) and events, as ``BlockStoreOwner.commit`` says."""
        if slots:
            if self._session is None:
                raise ClientDetachedError("the local session is closed")
            self._owner.commit(self._session, slots, generations)

    def abort(self, slots: list[int], generations: list[int]) -> None:
        if slots:
            self._call(Abort(slots, generations), Done)

    def lease(self, keys: Sequence[BlockKey]) -> Slots:
        """Pin the held keys' slots (``None`` for keys not held) until released or closed."""
        return self._call(req.lease(keys), Slots)

    def release(self, slots: list[int], generations: list[int]) -> None:
        if slots and self._session is not None:
            self._owner.handle(self._session, encode(Release(slots, generations))[4:])

    def remove(self, keys: Sequence[BlockKey]) -> list[bool]:
        values: list[bool] = self._call(req.remove(keys), Flags).values
        return values

    def generations(self, slots: Sequence[int]) -> list[int]:
        """The slots' current generations (changed on reuse)."""
        if self._owner.segment is None:
            raise ClientDetachedError("the block store owner is not running")
        table = self._owner.segment.generations
        return [int(table[s]) for s in slots]

    def close(self) -> None:
        """Free reservations and release leases still held (idempotent)."""
        session, self._session = self._session, None
        self.rows = np.empty((0, self.block_bytes), np.uint8)  # let the owner unmap
        if session is not None and self._owner.store is not None:
            self._owner.store.close_session(session)

    @property
    def closed(self) -> bool:
        return self._session is None

    def __enter__(self) -> LocalSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
