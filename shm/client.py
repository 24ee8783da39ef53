"""The blocking client, for engine threads: one socket, one mapping, thread-safe.

    with BlockStoreClient("/run/kv/store.sock") as store:
        store.put_many(keys, arrays)             # reserve → copy into the mapping → commit
        hits = store.get_many(keys, outs)        # lease → copy out → release (no wait)

Keys are ``(namespace_seed, block_hash)`` pairs. Arrays are numpy arrays or torch tensors
of exactly one block (see ``shm._blocks``). Block bytes never cross the socket: one small
frame per batch asks for slots, and the copy goes straight to or from the mapped segment.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from shm._attachment import Attachment, descriptors, expect, split_keys, stats_from_reply
from shm.errors import ClientDetachedError, UnknownBlockError
from shm.protocol import (
    PROTOCOL_VERSION,
    Abort,
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

__all__ = ["BlockStoreClient", "PendingPut"]


class PendingPut:
    """Reserved slots for a put: write ``views`` in place, then ``commit()`` (or ``abort()``).

    ``views[i]`` is a writable uint8 view of key ``i``'s slot, or ``None`` when the store
    already holds (or is being given) that key. Nothing is visible to readers until commit;
    after ``commit()`` or ``abort()`` the views must not be written (or kept) any more.
    ``commit()`` is one-way, as ``put_many``'s: the blocks are visible to every request sent
    after it returns, without waiting for the owner.
    """

    def __init__(self, client: BlockStoreClient, reply: Slots, keys: Sequence[BlockKey]) -> None:
        self._client = client
        self._reply = reply
        self._keys = keys
        self.views = client._attachment.views(reply, writable=True)
        self._slots, self._generations = descriptors(reply)
        self.stored = [s is not None for s in reply.slots]
        self._open = True

    def commit(self) -> None:
        if self._open:
            self._open = False
            if self._slots:
                self._client._attachment.publish_filled(self._keys, self._reply)
                self._client._send_only(Publish(self._slots, self._generations))

    def abort(self) -> None:
        if self._open:
            self._open = False
            if self._slots:
                self._client._call(Abort(self._slots, self._generations), Done)

    def __enter__(self) -> PendingPut:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.commit()
            return
        # Keep the caller's error in front: if the owner is gone it frees the reservation
        # itself when our socket closes.
        with contextlib.suppress(ClientDetachedError):
            self.abort()


class BlockStoreClient:
    """Connects to an owner's socket and attaches its segment."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        expected_owner_id: str | None = None,
        timeout_s: float = 10.0,
        optimistic_reads: bool = True,
        register_cuda: bool = True,
    ) -> None:
        """``optimistic_reads``: gets read through the segment's read index, asking the
        owner only for what it does not show (see ``shm.read_index``); False: every get
        leases through the owner. ``register_cuda``: the first copy of a CUDA tensor pins
        the mapping for CUDA, so GPU copies DMA straight to it (see ``shm._cuda``)."""
        self.socket_path = Path(socket_path)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._buf = bytearray()
        try:
            self._sock.settimeout(timeout_s)
            self._sock.connect(str(self.socket_path))
            welcome = self._call(Hello(PROTOCOL_VERSION, os.getpid()), Welcome)
            self._attachment = Attachment(welcome, expected_owner_id,
                                          optimistic_reads=optimistic_reads,
                                          register_cuda=register_cuda)
        except BaseException:
            self._detach()
            raise
        self.welcome = welcome
        self.format = self._attachment.format

    # -------------------------------------------------------------- properties
    @property
    def block_bytes(self) -> int:
        return self.welcome.block_bytes

    @property
    def dtype(self) -> str:
        return self.welcome.dtype

    @property
    def num_slots(self) -> int:
        return self.welcome.num_slots

    # -------------------------------------------------------------------- puts
    def put(self, key: BlockKey, array: Any, *, parent_hash: int | None = None,
            token_ids: list[int] | None = None) -> bool:
        """Store one block; ``False`` if the store held it or another client is writing it."""
        return self.put_many([key], [array], parent_hashes=[parent_hash],
                             token_ids=None if token_ids is None else [token_ids])[0]

    def put_many(
        self,
        keys: Sequence[BlockKey],
        arrays: Sequence[Any],
        *,
        parent_hashes: Sequence[int | None] | None = None,
        token_ids: Sequence[list[int] | None] | None = None,
    ) -> list[bool]:
        """Store blocks (one reserve round trip, then a one-way commit); per key, whether copied.

        A key the store already holds, or that another client is writing, is skipped
        (``False``). All or nothing otherwise: ``StoreFullError`` stores none of them.
        """
        checked = self._attachment.check_blocks(arrays, len(keys), out=False)
        reply = self._call(self._reserve(keys, parent_hashes, token_ids), Slots)
        try:
            slots, gens = self._attachment.write_blocks(reply, checked)
        except BaseException:
            self._abort_quietly(reply)
            raise
        if slots:  # one-way: see Publish in shm.protocol for why it is visible on return
            self._attachment.publish_filled(keys, reply)
            self._send_only(Publish(slots, gens))
        return [s is not None for s in reply.slots]

    def begin_put(
        self,
        keys: Sequence[BlockKey],
        *,
        parent_hashes: Sequence[int | None] | None = None,
        token_ids: Sequence[list[int] | None] | None = None,
    ) -> PendingPut:
        """Reserve slots to fill in place (e.g. a device-to-host copy straight into them)."""
        reply = self._call(self._reserve(keys, parent_hashes, token_ids), Slots)
        return PendingPut(self, reply, keys)

    @staticmethod
    def _reserve(keys: Sequence[BlockKey], parents: Sequence[int | None] | None,
                 tokens: Sequence[list[int] | None] | None) -> Reserve:
        namespaces, hashes = split_keys(keys)
        for name, extra in (("parent_hashes", parents), ("token_ids", tokens)):
            if extra is not None and len(extra) != len(keys):
                raise ValueError(f"{len(extra)} {name} for {len(keys)} keys")
        return Reserve(namespaces, hashes,
                       None if parents is None else list(parents),
                       None if tokens is None else list(tokens))

    def _abort_quietly(self, reply: Slots) -> None:
        slots, gens = descriptors(reply)
        if slots and self._sock is not None:
            # If the owner is gone it frees the reservation itself when our socket closes.
            with contextlib.suppress(ClientDetachedError):
                self._call(Abort(slots, gens), Done)

    # -------------------------------------------------------------------- gets
    def get(self, key: BlockKey, out: Any = None) -> Any:
        """One block's bytes, into ``out`` or a new flat array; ``UnknownBlockError`` if absent."""
        target = self.format.new_array() if out is None else out
        if not self.get_many([key], [target])[0]:
            raise UnknownBlockError(f"block {key} is not in the store")
        return target

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> list[bool]:
        """Copy each held block into its ``outs`` entry; per key, a hit.

        Blocks the segment's read index shows are copied without asking the owner; the rest
        (misses included) take one lease round trip. A missed key's ``outs`` entry may have
        been written.
        """
        attachment = self._attachment
        checked = attachment.check_blocks(outs, len(keys), out=True)
        if not attachment.reads_optimistically:
            return self._get_leased(keys, checked)
        hits = attachment.read_optimistic(keys, checked)
        found = hits.count(True)
        if found:
            with self._lock:
                attachment.count_hits(found)
        if found == len(hits):
            return hits
        rest = [i for i, hit in enumerate(hits) if not hit]
        for i, hit in zip(rest, self._get_leased([keys[i] for i in rest],
                                                 [checked[i] for i in rest]), strict=True):
            hits[i] = hit
        return hits

    def _get_leased(self, keys: Sequence[BlockKey], checked: list[Any]) -> list[bool]:
        reply = self._call(Lease(*split_keys(keys)), Slots)
        self._attachment.remember(keys, reply)
        try:
            self._attachment.read_blocks(reply, checked)
        finally:
            slots, gens = descriptors(reply)
            if slots:
                self._send_only(Release(slots, gens))
        return [s is not None for s in reply.slots]

    @contextmanager
    def leased(self, keys: Sequence[BlockKey]) -> Iterator[list[np.ndarray | None]]:
        """Read-only views of the held blocks (``None`` if absent), valid inside the block."""
        reply = self._call(Lease(*split_keys(keys)), Slots)
        self._attachment.remember(keys, reply)
        try:
            yield self._attachment.views(reply, writable=False)
        finally:
            slots, gens = descriptors(reply)
            if slots and self._sock is not None:
                self._send_only(Release(slots, gens))

    def read(self, keys: Sequence[BlockKey],
             copy: Callable[[int, np.ndarray], None]) -> list[bool]:
        """``copy(i, view)`` for each held key ``i`` (a read-only view of its block); per key,
        whether it was held and its copy stands.

        The copy-out of ``get_many`` with the copy left to the caller (e.g. into an engine's
        host KV pool layout): blocks the read index shows are read without the owner, and a
        key whose slot was retracted meanwhile is read again under a lease, so ``copy`` may
        run twice for a key and must simply overwrite. The views are valid only inside
        ``copy``.
        """
        attachment = self._attachment
        hits = [False] * len(keys)
        if attachment.reads_optimistically:
            hits = attachment.read_views_optimistic(keys, copy)
            found = hits.count(True)
            if found:
                with self._lock:
                    attachment.count_hits(found)
            if found == len(keys):
                return hits
        rest = [i for i, hit in enumerate(hits) if not hit]
        with self.leased([keys[i] for i in rest]) as views:
            for i, view in zip(rest, views, strict=True):
                if view is not None:
                    copy(i, view)
                    hits[i] = True
        return hits

    def contains(self, key: BlockKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        return self._call(Contains(*split_keys(keys)), Flags).values

    def remove_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Drop blocks from the store; per key, whether it was held."""
        return self._call(Remove(*split_keys(keys)), Flags).values

    def stats(self) -> StoreStats:
        return stats_from_reply(self._call(Stats(), StatsReply))

    def ping(self) -> None:
        self._call(Ping(), Done)

    # ---------------------------------------------------------------- transport
    def _call(self, request: Any, kind: type[R]) -> R:
        frame = _encode(request)
        with self._lock:
            sock = self._live_socket()
            try:
                sock.sendall(frame)
                reply = self._recv(sock)
            except (OSError, ClientDetachedError) as exc:
                self._detach()
                raise ClientDetachedError(
                    f"lost the block store owner on {self.socket_path}: {exc}") from exc
            except BaseException:
                self._detach()  # interrupted mid round trip: replies would no longer pair
                raise
        return expect(reply, kind)

    def _send_only(self, request: Any) -> None:
        frame = _encode(request)
        with self._lock:
            sock = self._live_socket()
            try:
                sock.sendall(frame)
            except OSError as exc:
                self._detach()
                raise ClientDetachedError(
                    f"lost the block store owner on {self.socket_path}: {exc}") from exc

    def _live_socket(self) -> socket.socket:
        if self._sock is None:
            raise ClientDetachedError(f"the client of {self.socket_path} is closed")
        return self._sock

    def _recv(self, sock: socket.socket) -> Reply:
        buf = self._buf
        while len(buf) < 4:
            self._fill(sock, buf)
        length = frame_length(buf)
        while len(buf) < 4 + length:
            self._fill(sock, buf)
        body = bytes(buf[4 : 4 + length])
        del buf[: 4 + length]
        return decode_reply(body)

    @staticmethod
    def _fill(sock: socket.socket, buf: bytearray) -> None:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ClientDetachedError("the owner closed the connection")
        buf += chunk

    def _detach(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        """Close the socket (the owner releases what we held) and unmap; idempotent."""
        with self._lock:
            self._detach()
        self._attachment.close()

    def __enter__(self) -> BlockStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _encode(request: Any) -> bytes:
    try:
        return encode(request)
    except (OverflowError, TypeError) as exc:  # e.g. a block hash of 2**64 or more
        raise ValueError(
            f"{type(request).__name__} request holds a value the control channel cannot "
            f"carry (keys are pairs of unsigned 64-bit integers): {exc}"
        ) from exc
