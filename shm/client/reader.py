"""A lease-only client of another owner's store, with that owner's segment mapped read-only.

How one sidecar reads a peer sidecar's blocks on the same host: connect to the peer's
control socket, ``lease`` the keys (one frame each way), copy the leased slots out of the
read-only mapping, ``release`` (one frame, no reply). The leases belong to this
connection, so if the reader dies, the peer's owner releases them when the socket closes,
as for any client. The reader can never write the peer's memory: the segment is opened
``O_RDONLY`` and mapped ``PROT_READ``.

    reader = await AsyncSegmentReader.connect(peer_socket, expected_owner_id="replica-1")
    reply = await reader.lease(keys)                 # Slots: None where the peer lacks a key
    ... copy reader.rows[slot] for the leased slots ...
    reader.release(slots, generations)
    await reader.aclose()

One request is in flight at a time per reader (``shm.client._transport.StreamChannel``, as for
``AsyncBlockStoreClient``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

import numpy as np

import shm.client._requests as req
from shm.client._transport import StreamChannel
from shm.client.readonly import ReadOnlySegment
from shm.errors import ForeignSegmentError, HeaderCorruptError
from shm.owner.store import BlockKey
from shm.protocol import Release, Slots, Welcome

__all__ = ["AsyncSegmentReader"]


class AsyncSegmentReader:
    """Build with ``await AsyncSegmentReader.connect(socket_path)``."""

    def __init__(self, channel: StreamChannel, welcome: Welcome,
                 segment: ReadOnlySegment) -> None:
        self._channel = channel
        self.welcome = welcome
        self.segment = segment
        self.socket_path = channel.socket_path
        self.timeout_s = channel.timeout_s

    @classmethod
    async def connect(cls, socket_path: str | os.PathLike[str], *,
                      expected_owner_id: str | None = None,
                      timeout_s: float = 10.0) -> AsyncSegmentReader:
        """Connect, check the owner, map its segment read-only (``FileNotFoundError`` and
        ``ConnectionRefusedError`` mean no such owner on this host)."""
        channel, welcome = await StreamChannel.open(socket_path, timeout_s=timeout_s)
        try:
            if expected_owner_id is not None and welcome.owner_id != expected_owner_id:
                raise ForeignSegmentError(f"the owner on {channel.socket_path} is "
                                          f"{welcome.owner_id!r}, expected "
                                          f"{expected_owner_id!r}")
            segment = await asyncio.to_thread(ReadOnlySegment.attach, welcome.segment,
                                              welcome.owner_id)
        except BaseException:
            await channel.aclose()
            raise
        header = segment.header
        if (header.block_bytes, header.num_slots, header.dtype) != (
                welcome.block_bytes, welcome.num_slots, welcome.dtype):
            segment.close()
            await channel.aclose()
            raise HeaderCorruptError(f"segment {welcome.segment} disagrees with its owner's "
                                     "welcome about its geometry")
        return cls(channel, welcome, segment)

    @property
    def rows(self) -> np.ndarray:
        """``rows[slot]``: the block in ``slot`` (read-only uint8 view)."""
        return self.segment.rows

    @property
    def closed(self) -> bool:
        return self._channel.closed

    async def lease(self, keys: Sequence[BlockKey]) -> Slots:
        """Pin the held keys' slots (``None`` for keys the owner lacks)."""
        return await self._channel.call(req.lease(keys), Slots)

    def release(self, slots: list[int], generations: list[int]) -> None:
        """Give leases back (no reply; a closed connection has released them already)."""
        if slots and not self.closed:
            self._channel.send_only(Release(slots, generations))

    def stale_slots(self, slots: list[int], generations: list[int]) -> list[int]:
        """Slots reused since they were leased (never, while a lease holds)."""
        return self.segment.check_generations(slots, generations)

    async def aclose(self) -> None:
        """Close the connection (the owner releases our leases) and unmap; idempotent."""
        await self._channel.aclose()
        self.segment.close()
