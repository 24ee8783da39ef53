"""The asyncio client, for the sidecar: same operations as ``BlockStoreClient``, awaited.

    async with await AsyncBlockStoreClient.connect(path) as store:
        await store.put_many(keys, arrays)

Control frames go over an asyncio Unix stream (``shm.client._transport.StreamChannel``); one
request is in flight at a time per client. Puts commit as the blocking client's do, by
publishing their slots in the read index (``shm.client._puts``). Copies bigger than
``inline_copy_bytes`` run in a worker thread so a large batch never stalls the event loop;
small ones run inline, where a thread hop would cost more than the copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import numpy as np

import shm.client._requests as req
from shm.client._attachment import Attachment
from shm.client._puts import AsyncPendingPut
from shm.client._transport import StreamChannel
from shm.errors import UnknownBlockError
from shm.owner.store import BlockKey, StoreStats
from shm.protocol import Done, Flags, Reserve, Slots, StatsReply

__all__ = ["AsyncBlockStoreClient", "AsyncPendingPut"]

_Descriptors = tuple[list[int], list[int]]  # slots, generations
_Copy = Callable[[Slots, list[Any]], _Descriptors]


class AsyncBlockStoreClient:
    """Build with ``await AsyncBlockStoreClient.connect(socket_path)``."""

    def __init__(self, channel: StreamChannel, attachment: Attachment, *,
                 inline_copy_bytes: int) -> None:
        self._channel = channel
        self._attachment = attachment
        self.socket_path = channel.socket_path
        self.timeout_s = channel.timeout_s
        self.inline_copy_bytes = inline_copy_bytes
        self.welcome = attachment.welcome
        self.format = attachment.format

    @classmethod
    async def connect(
        cls,
        socket_path: str | os.PathLike[str],
        *,
        expected_owner_id: str | None = None,
        timeout_s: float = 10.0,
        inline_copy_bytes: int = 1 << 20,
        optimistic_reads: bool = True,
        register_cuda: bool = True,
    ) -> AsyncBlockStoreClient:
        """``optimistic_reads``, ``register_cuda``: as for ``BlockStoreClient``."""
        channel, welcome = await StreamChannel.open(socket_path, timeout_s=timeout_s)
        try:
            attachment = Attachment(welcome, expected_owner_id,
                                    optimistic_reads=optimistic_reads,
                                    register_cuda=register_cuda)
        except BaseException:
            await channel.aclose()
            raise
        return cls(channel, attachment, inline_copy_bytes=inline_copy_bytes)

    @property
    def block_bytes(self) -> int:
        return self.welcome.block_bytes

    # -------------------------------------------------------------------- puts
    async def put(self, key: BlockKey, array: Any, *, parent_hash: int | None = None,
                  token_ids: list[int] | None = None) -> bool:
        """Store one block; ``False`` if the store held it or another client is writing it."""
        stored = await self.put_many([key], [array], parent_hashes=[parent_hash],
                                     token_ids=None if token_ids is None else [token_ids])
        return stored[0]

    async def put_many(self, keys: Sequence[BlockKey], arrays: Sequence[Any], *,
                       parent_hashes: req.Parents = None,
                       token_ids: req.Tokens = None) -> list[bool]:
        """Store blocks (one reserve round trip, then a commit that waits for nothing); per
        key, whether copied.

        Unlike the blocking client's, these puts take no slots granted ahead: each reserves.

        A key the store already holds, or that another client is writing, is skipped
        (``False``). All or nothing otherwise: ``StoreFullError`` stores none of them.
        """
        checked = self._attachment.check_blocks(arrays, len(keys), out=False)
        fields = req.put_fields(keys, parent_hashes, token_ids)
        reply = await self._channel.call(Reserve(*fields), Slots)
        try:
            await self._copy(self._attachment.write_blocks, reply, checked)
        except BaseException:
            abort = req.abort(reply)
            if abort is not None and not self._channel.closed:
                await self._channel.call(abort, Done)
            raise
        publish = self._attachment.commit_filled(keys, reply, fields[1])
        if publish is not None:
            self._channel.send_only(publish)
        return [s is not None for s in reply.slots]

    async def begin_put(self, keys: Sequence[BlockKey], *, parent_hashes: req.Parents = None,
                        token_ids: req.Tokens = None) -> AsyncPendingPut:
        """Reserve slots to fill in place; commit (or abort) the returned ``AsyncPendingPut``."""
        request = Reserve(*req.put_fields(keys, parent_hashes, token_ids))
        reply = await self._channel.call(request, Slots)
        return AsyncPendingPut(self._channel, self._attachment, keys, reply)

    # -------------------------------------------------------------------- gets
    async def get(self, key: BlockKey, out: Any = None) -> Any:
        """One block's bytes, into ``out`` or a new flat array; ``UnknownBlockError`` if absent."""
        target = self.format.new_array() if out is None else out
        if not (await self.get_many([key], [target]))[0]:
            raise UnknownBlockError(f"block {key} is not in the store")
        return target

    async def get_many(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> list[bool]:
        """Copy each held block into its ``outs`` entry; per key, a hit.

        As ``BlockStoreClient.get_many``: what the read index shows without the owner, the
        rest with one lease round trip; a missed key's ``outs`` entry may have been written.
        """
        attachment = self._attachment
        checked = attachment.check_blocks(outs, len(keys), out=True)
        if not attachment.reads_optimistically:
            return await self._get_leased(keys, checked)
        if len(keys) * self.block_bytes > self.inline_copy_bytes:
            hits = await asyncio.to_thread(attachment.read_optimistic, keys, checked)
        else:
            hits = attachment.read_optimistic(keys, checked)
        found = hits.count(True)
        attachment.count_hits(found)  # one event loop thread: no other writer of our cell
        if found == len(hits):
            return hits
        rest = [i for i, hit in enumerate(hits) if not hit]
        leased = await self._get_leased([keys[i] for i in rest], [checked[i] for i in rest])
        for i, hit in zip(rest, leased, strict=True):
            hits[i] = hit
        return hits

    async def _get_leased(self, keys: Sequence[BlockKey], checked: list[Any]) -> list[bool]:
        reply = await self._channel.call(req.lease(keys), Slots)
        self._attachment.remember(keys, reply)
        try:
            await self._copy(self._attachment.read_blocks, reply, checked)
        finally:
            self._release(reply)
        return [s is not None for s in reply.slots]

    @contextlib.asynccontextmanager
    async def leased(self, keys: Sequence[BlockKey]) -> AsyncIterator[list[np.ndarray | None]]:
        """Read-only views of the held blocks (``None`` if absent), valid inside the block."""
        reply = await self._channel.call(req.lease(keys), Slots)
        try:
            yield self._attachment.views(reply, writable=False)
        finally:
            self._release(reply)

    def _release(self, reply: Slots) -> None:
        """Give a lease's slots back (one-way; a closed connection has released them)."""
        release = req.release(reply)
        if release is not None and not self._channel.closed:
            self._channel.send_only(release)

    async def contains(self, key: BlockKey) -> bool:
        return (await self.contains_many([key]))[0]

    async def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        return (await self._channel.call(req.contains(keys), Flags)).values

    async def remove_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        return (await self._channel.call(req.remove(keys), Flags)).values

    async def stats(self) -> StoreStats:
        return (await self._channel.call(req.STATS, StatsReply)).stats

    async def ping(self) -> None:
        await self._channel.call(req.PING, Done)

    async def _copy(self, fn: _Copy, reply: Slots, arrays: list[Any]) -> _Descriptors:
        copied = sum(s is not None for s in reply.slots) * self.block_bytes
        if copied > self.inline_copy_bytes:
            return await asyncio.to_thread(fn, reply, arrays)
        return fn(reply, arrays)

    async def aclose(self) -> None:
        """Close the connection (the owner releases what we held) and unmap; idempotent."""
        await self._channel.aclose()
        self._attachment.close()

    async def __aenter__(self) -> AsyncBlockStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
