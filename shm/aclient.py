"""The asyncio client, for the sidecar: same operations as ``BlockStoreClient``, awaited.

    async with await AsyncBlockStoreClient.connect(path) as store:
        await store.put_many(keys, arrays)

Control frames go over an asyncio Unix stream; one request is in flight at a time per
client (a lock pairs requests with replies). Copies bigger than ``inline_copy_bytes`` run
in a worker thread so a large batch never stalls the event loop; small ones run inline,
where a thread hop would cost more than the copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from shm._attachment import Attachment, descriptors, expect, split_keys, stats_from_reply
from shm.errors import ClientDetachedError, UnknownBlockError
from shm.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Commit,
    Contains,
    Done,
    Flags,
    Hello,
    Lease,
    Ping,
    Publish,
    Release,
    Remove,
    Reply,
    Reserve,
    Slots,
    Stats,
    StatsReply,
    Welcome,
    decode_reply,
    encode,
    frame_length,
)
from shm.store import BlockKey, StoreStats

R = TypeVar("R")

__all__ = ["AsyncBlockStoreClient", "AsyncPendingPut"]


class AsyncPendingPut:
    """Reserved slots to fill in place (e.g. a transfer received straight into them).

    ``views[i]`` is a writable uint8 view of key ``i``'s slot, or ``None`` when the store
    already holds (or is being given) that key. ``async with`` commits on success and aborts
    on error; after either, the views must not be written or kept.
    """

    def __init__(self, client: AsyncBlockStoreClient, reply: Slots) -> None:
        self._client = client
        self.views = client._attachment.views(reply, writable=True)
        self._slots, self._generations = descriptors(reply)
        self.stored = [s is not None for s in reply.slots]
        self._open = True

    async def commit(self) -> None:
        if self._open:
            self._open = False
            if self._slots:
                await self._client._call(Commit(self._slots, self._generations), Done)

    async def abort(self) -> None:
        if self._open:
            self._open = False
            if self._slots:
                await self._client._call(Abort(self._slots, self._generations), Done)

    async def __aenter__(self) -> AsyncPendingPut:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            await self.commit()
            return
        with contextlib.suppress(ClientDetachedError):  # keep the caller's error in front
            await self.abort()


class AsyncBlockStoreClient:
    """Build with ``await AsyncBlockStoreClient.connect(socket_path)``."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        attachment: Attachment,
        *,
        socket_path: str,
        timeout_s: float,
        inline_copy_bytes: int,
    ) -> None:
        self._reader = reader
        self._writer: asyncio.StreamWriter | None = writer
        self._attachment = attachment
        self._lock = asyncio.Lock()
        self.socket_path = socket_path
        self.timeout_s = timeout_s
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
        path = os.fspath(socket_path)
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_unix_connection(path)
        try:
            writer.write(encode(Hello(PROTOCOL_VERSION, os.getpid())))
            async with asyncio.timeout(timeout_s):
                welcome = expect(await _read_reply(reader), Welcome)
            attachment = Attachment(welcome, expected_owner_id,
                                    optimistic_reads=optimistic_reads,
                                    register_cuda=register_cuda)
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer, attachment, socket_path=path, timeout_s=timeout_s,
                   inline_copy_bytes=inline_copy_bytes)

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

    async def put_many(
        self,
        keys: Sequence[BlockKey],
        arrays: Sequence[Any],
        *,
        parent_hashes: Sequence[int | None] | None = None,
        token_ids: Sequence[list[int] | None] | None = None,
    ) -> list[bool]:
        """Store blocks (one reserve round trip, then a commit that waits for nothing); per
        key, whether copied.

        Unlike the blocking client's, these puts take no slots granted ahead: each reserves.

        A key the store already holds, or that another client is writing, is skipped
        (``False``). All or nothing otherwise: ``StoreFullError`` stores none of them.
        """
        checked = self._attachment.check_blocks(arrays, len(keys), out=False)
        for name, extra in (("parent_hashes", parent_hashes), ("token_ids", token_ids)):
            if extra is not None and len(extra) != len(keys):
                raise ValueError(f"{len(extra)} {name} for {len(keys)} keys")
        request = Reserve(*split_keys(keys),
                          None if parent_hashes is None else list(parent_hashes),
                          None if token_ids is None else list(token_ids))
        reply = await self._call(request, Slots)
        try:
            slots, gens = await self._copy(self._attachment.write_blocks, reply, checked)
        except BaseException:
            slots, gens = descriptors(reply)
            if slots and self._writer is not None:
                await self._call(Abort(slots, gens), Done)
            raise
        # Publishing in the read index commits; else one-way: see Publish in shm.protocol
        # for why the blocks are visible once this returns.
        if slots and not self._attachment.publish_filled(keys, reply.slots):
            await self._send_only(Publish(slots, gens))
        return [s is not None for s in reply.slots]

    async def begin_put(
        self,
        keys: Sequence[BlockKey],
        *,
        parent_hashes: Sequence[int | None] | None = None,
        token_ids: Sequence[list[int] | None] | None = None,
    ) -> AsyncPendingPut:
        """Reserve slots to fill in place; commit (or abort) the returned ``AsyncPendingPut``."""
        for name, extra in (("parent_hashes", parent_hashes), ("token_ids", token_ids)):
            if extra is not None and len(extra) != len(keys):
                raise ValueError(f"{len(extra)} {name} for {len(keys)} keys")
        request = Reserve(*split_keys(keys),
                          None if parent_hashes is None else list(parent_hashes),
                          None if token_ids is None else list(token_ids))
        return AsyncPendingPut(self, await self._call(request, Slots))

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
        reply = await self._call(Lease(*split_keys(keys)), Slots)
        self._attachment.remember(keys, reply)
        try:
            await self._copy(self._attachment.read_blocks, reply, checked)
        finally:
            slots, gens = descriptors(reply)
            if slots and self._writer is not None:
                await self._send_only(Release(slots, gens))
        return [s is not None for s in reply.slots]

    @contextlib.asynccontextmanager
    async def leased(self, keys: Sequence[BlockKey]) -> AsyncIterator[list[np.ndarray | None]]:
        """Read-only views of the held blocks (``None`` if absent), valid inside the block."""
        reply = await self._call(Lease(*split_keys(keys)), Slots)
        try:
            yield self._attachment.views(reply, writable=False)
        finally:
            slots, gens = descriptors(reply)
            if slots and self._writer is not None:
                await self._send_only(Release(slots, gens))

    async def contains(self, key: BlockKey) -> bool:
        return (await self.contains_many([key]))[0]

    async def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        values: list[bool] = (await self._call(Contains(*split_keys(keys)), Flags)).values
        return values

    async def remove_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        values: list[bool] = (await self._call(Remove(*split_keys(keys)), Flags)).values
        return values

    async def stats(self) -> StoreStats:
        return stats_from_reply(await self._call(Stats(), StatsReply))

    async def ping(self) -> None:
        await self._call(Ping(), Done)

    async def _copy(self, fn: Any, reply: Slots, arrays: list[Any]) -> tuple[list[int], list[int]]:
        copied = sum(s is not None for s in reply.slots) * self.block_bytes
        if copied > self.inline_copy_bytes:
            result: tuple[list[int], list[int]] = await asyncio.to_thread(fn, reply, arrays)
            return result
        result = fn(reply, arrays)
        return result

    # ---------------------------------------------------------------- transport
    async def _call(self, request: Any, kind: type[R]) -> R:
        frame = _encode(request)
        async with self._lock:
            writer = self._live_writer()
            try:
                writer.write(frame)
                async with asyncio.timeout(self.timeout_s):
                    reply = await _read_reply(self._reader)
            except (OSError, TimeoutError, asyncio.IncompleteReadError,
                    ClientDetachedError) as exc:
                self._detach()
                raise ClientDetachedError(
                    f"lost the block store owner on {self.socket_path}: {exc!r}") from exc
            except BaseException:
                # Cancelled between request and reply: the late reply would pair with the
                # next request, so drop the connection (the owner frees what it held).
                self._detach()
                raise
        return expect(reply, kind)

    async def _send_only(self, request: Any) -> None:
        frame = _encode(request)
        async with self._lock:
            self._live_writer().write(frame)

    def _live_writer(self) -> asyncio.StreamWriter:
        if self._writer is None or self._writer.is_closing():
            raise ClientDetachedError(f"the client of {self.socket_path} is closed")
        return self._writer

    def _detach(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def aclose(self) -> None:
        """Close the connection (the owner releases what we held) and unmap; idempotent."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):  # the owner went away: nothing to flush
                await writer.wait_closed()
        self._attachment.close()

    async def __aenter__(self) -> AsyncBlockStoreClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


async def _read_reply(reader: asyncio.StreamReader) -> Reply:
    prefix = await reader.readexactly(4)
    body = await reader.readexactly(frame_length(prefix))
    return decode_reply(body)


def _encode(request: Any) -> bytes:
    try:
        return encode(request)
    except (OverflowError, TypeError) as exc:  # e.g. a block hash of 2**64 or more
        raise ValueError(
            f"{type(request).__name__} request holds a value the control channel cannot "
            f"carry (keys are pairs of unsigned 64-bit integers): {exc}"
        ) from exc
