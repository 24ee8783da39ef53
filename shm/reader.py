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

One request is in flight at a time per reader (a lock pairs requests with replies).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from shm._attachment import expect, split_keys
from shm.errors import ClientDetachedError, ForeignSegmentError, HeaderCorruptError
from shm.protocol import (
    PROTOCOL_VERSION,
    Hello,
    Lease,
    Release,
    Reply,
    Slots,
    Welcome,
    decode_reply,
    encode,
    frame_length,
)
from shm.readonly import ReadOnlySegment
from shm.store import BlockKey

__all__ = ["AsyncSegmentReader"]

R = TypeVar("R")


class AsyncSegmentReader:
    """Build with ``await AsyncSegmentReader.connect(socket_path)``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 welcome: Welcome, segment: ReadOnlySegment, *, socket_path: str,
                 timeout_s: float) -> None:
        self._reader = reader
        self._writer: asyncio.StreamWriter | None = writer
        self._lock = asyncio.Lock()
        self.welcome = welcome
        self.segment = segment
        self.socket_path = socket_path
        self.timeout_s = timeout_s

    @classmethod
    async def connect(cls, socket_path: str | os.PathLike[str], *,
                      expected_owner_id: str | None = None,
                      timeout_s: float = 10.0) -> AsyncSegmentReader:
        """Connect, check the owner, map its segment read-only (``FileNotFoundError`` and
        ``ConnectionRefusedError`` mean no such owner on this host)."""
        path = os.fspath(socket_path)
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_unix_connection(path)
        try:
            writer.write(encode(Hello(PROTOCOL_VERSION, os.getpid())))
            async with asyncio.timeout(timeout_s):
                welcome = expect(await _read_reply(reader), Welcome)
            if expected_owner_id is not None and welcome.owner_id != expected_owner_id:
                raise ForeignSegmentError(f"the owner on {path} is {welcome.owner_id!r}, "
                                          f"expected {expected_owner_id!r}")
            segment = await asyncio.to_thread(ReadOnlySegment.attach, welcome.segment,
                                              welcome.owner_id)
        except BaseException:
            writer.close()
            raise
        header = segment.header
        if (header.block_bytes, header.num_slots, header.dtype) != (
                welcome.block_bytes, welcome.num_slots, welcome.dtype):
            segment.close()
            writer.close()
            raise HeaderCorruptError(f"segment {welcome.segment} disagrees with its owner's "
                                     "welcome about its geometry")
        return cls(reader, writer, welcome, segment, socket_path=path, timeout_s=timeout_s)

    @property
    def rows(self) -> np.ndarray:
        """``rows[slot]``: the block in ``slot`` (read-only uint8 view)."""
        return self.segment.rows

    @property
    def closed(self) -> bool:
        return self._writer is None or self._writer.is_closing()

    async def lease(self, keys: Sequence[BlockKey]) -> Slots:
        """Pin the held keys' slots (``None`` for keys the owner lacks)."""
        return await self._call(Lease(*split_keys(keys)), Slots)

    def release(self, slots: list[int], generations: list[int]) -> None:
        """Give leases back (no reply; a closed connection has released them already)."""
        if slots and not self.closed:
            assert self._writer is not None
            self._writer.write(encode(Release(slots, generations)))

    def stale_slots(self, slots: list[int], generations: list[int]) -> list[int]:
        """Slots reused since they were leased (never, while a lease holds)."""
        return self.segment.check_generations(slots, generations)

    async def _call(self, request: Any, kind: type[R]) -> R:
        frame = encode(request)
        async with self._lock:
            if self.closed:
                raise ClientDetachedError(f"the reader of {self.socket_path} is closed")
            assert self._writer is not None
            try:
                self._writer.write(frame)
                async with asyncio.timeout(self.timeout_s):
                    reply = await _read_reply(self._reader)
            except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
                self._detach()
                raise ClientDetachedError(
                    f"lost the block store owner on {self.socket_path}: {exc!r}") from exc
            except BaseException:
                self._detach()  # a late reply would pair with the next request
                raise
        return expect(reply, kind)

    def _detach(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def aclose(self) -> None:
        """Close the connection (the owner releases our leases) and unmap; idempotent."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        self.segment.close()


async def _read_reply(reader: asyncio.StreamReader) -> Reply:
    prefix = await reader.readexactly(4)
    return decode_reply(await reader.readexactly(frame_length(prefix)))
