"""The blocking client, for engine threads: one socket, one mapping, thread-safe.

    with BlockStoreClient("/run/kv/store.sock") as store:
        store.put_many(keys, arrays)       # copy into slots granted ahead while claiming
                                           # them (or reserve first), then publish them in
                                           # the read index: that commits, no message
        hits = store.get_many(keys, outs)  # through the read index, or lease → copy → release

Keys are ``(namespace_seed, block_hash)`` pairs. Arrays are numpy arrays or torch tensors
of exactly one block (see ``shm._blocks``). Block bytes never cross the socket: one small
frame per batch asks for slots, and the copy goes straight to or from the mapped segment.

Requests and replies pair first-in first-out; each request takes a ticket, so a thread can
send a ``Claim``, copy, and only then collect its reply while other threads make calls.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from shm._attachment import Attachment, descriptors, expect, split_keys, stats_from_reply
from shm.errors import BlockStoreError, ClientDetachedError, ProtocolError, UnknownBlockError
from shm.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Claim,
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
    """Slots for a put: write ``views`` in place, then ``commit()`` (or ``abort()``).

    ``views[i]`` is a writable uint8 view of the slot for key ``i``, or ``None`` when the
    store already holds (or is being given) that key. Nothing is visible to readers until
    commit; after ``commit()`` or ``abort()`` the views must not be written (or kept) any
    more. ``commit()`` waits for no owner, as ``put_many``'s: it publishes the slots in the
    read index, which commits them (or, if the client does not read optimistically, sends
    a one-way ``Publish``); the blocks are visible to every request sent after it returns.

    A put's keys go in up to two parts: those that fit the slots granted to the client
    ahead, claimed for them (the ``Claim`` is on its way while the caller writes), and the
    rest, reserved (the owner answered before the views were handed out). A key the owner
    finds held while it handles the claim keeps a view that is written for nothing;
    ``stored``, read after the writes, says which keys took.
    """

    def __init__(self, client: BlockStoreClient, keys: Sequence[BlockKey],
                 parts: list[_Part]) -> None:
        self._client = client
        self._keys = keys
        self.parts = parts  # claimed part first: its slots are known at once
        self._views: list[np.ndarray | None] | None = None  # made on first use
        self._open = True
        self._aborted = False

    @property
    def views(self) -> list[np.ndarray | None]:
        if self._views is None:
            views: list[np.ndarray | None] = [None] * len(self._keys)
            rows = self._client._attachment.rows()
            for part in self.parts:
                for i, slot in zip(*self.write_plan(part), strict=True):
                    views[i] = rows[slot]
            self._views = views
        return self._views

    def write_plan(self, part: _Part) -> tuple[Sequence[int], Sequence[int]]:
        """The key indices and slots (parallel) of ``part`` to write: a reserved part's wait
        for the owner's reply, which raises ``StoreFullError`` if the store had no room."""
        if part.claimed_slots is not None:
            return part.todo, part.claimed_slots
        slots = self._answer(part).slots
        if None not in slots:
            return part.todo, slots  # type: ignore[return-value]
        pairs = [(i, s) for i, s in zip(part.todo, slots, strict=True) if s is not None]
        return [i for i, _ in pairs], [s for _, s in pairs]

    @property
    def stored(self) -> list[bool]:
        """Per key, whether this put gives the store its block (waits for a claim's reply);
        all ``False`` once aborted."""
        out = [False] * len(self._keys)
        if self._aborted:
            return out
        for part in self.parts:
            slots = self._answer(part).slots
            if part.whole and None not in slots:
                return [True] * len(self._keys)
            for i, slot in zip(part.todo, slots, strict=True):
                out[i] = slot is not None
        return out

    def _answer(self, part: _Part) -> Slots:
        if part.error is not None:
            raise part.error
        if part.reply is None:
            try:
                part.reply = self._client._slots_reply(part.ticket, len(part.todo))
            except BlockStoreError as exc:  # the reply was read: keep it for later asks
                part.error = exc
                raise
        return part.reply

    def commit(self) -> None:
        if not self._open:
            return
        try:
            replies = [self._answer(part) for part in self.parts]
        except BlockStoreError:  # e.g. a claim refused: free what the other part holds
            with contextlib.suppress(ClientDetachedError):
                self.abort()
            raise
        self._open = False
        client = self._client
        slots: list[int] = []
        generations: list[int] = []
        for part, reply in zip(self.parts, replies, strict=True):
            keys = self._keys if part.whole else [self._keys[i] for i in part.todo]
            if not client._attachment.publish_filled(keys, reply.slots):
                part_slots, part_generations = descriptors(reply)
                slots += part_slots
                generations += part_generations
        if slots:  # one-way: see Publish in shm.protocol for why it is visible on return
            client._send_only(Publish(slots, generations))

    def abort(self) -> None:
        if not self._open:
            return
        self._open = False
        self._aborted = True
        slots: list[int] = []
        generations: list[int] = []
        for part in self.parts:  # collect every reply, even past a failed reserve
            try:
                part_slots, part_generations = descriptors(self._answer(part))
            except BlockStoreError:  # e.g. StoreFullError: that part holds nothing
                continue
            slots += part_slots
            generations += part_generations
        if slots:
            self._client._call(Abort(slots, generations), Done)

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


@dataclass(slots=True)
class _Part:
    """Some of a put's keys, sent in one request whose reply may not be read yet."""

    ticket: int
    todo: Sequence[int]  # key indices
    claimed_slots: list[int] | None  # a claim's granted slots, one per key; None: reserved
    whole: bool = False  # todo is every key of the put, in order
    reply: Slots | None = None
    error: BlockStoreError | None = None  # the owner's error reply, e.g. StoreFullError


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
        spin_us: float = 200.0,
    ) -> None:
        """``optimistic_reads``: gets read through the segment's read index, asking the
        owner only for what it does not show (see ``shm.read_index``); False: every get
        leases through the owner. ``register_cuda``: the first copy of a CUDA tensor pins
        the mapping for CUDA, so GPU copies DMA straight to it (see ``shm._cuda``).
        ``spin_us``: how long a call busy-waits for its reply before it sleeps (0: never);
        ``timeout_s`` bounds each send and each wait for a reply."""
        if not timeout_s > 0 or spin_us < 0:
            raise ValueError(f"timeout_s must be > 0 and spin_us >= 0, got {timeout_s}, "
                             f"{spin_us}")
        self.socket_path = Path(socket_path)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._buf = bytearray()
        self._sent = self._answered = 0  # request tickets sent, replies read
        self._early: dict[int, Reply] = {}  # replies read before their thread asked
        # Slots granted ahead and not used yet, and their generations (parallel lists).
        self._granted: list[int] = []
        self._granted_gens: list[int] = []
        self._grant_want = 0  # granted slots to keep: the largest put so far
        self._spin_s = spin_us / 1e6
        try:
            self._sock.settimeout(timeout_s)
            self._sock.connect(str(self.socket_path))
            # Then a blocking socket with kernel timeouts, so that ``_recv_spinning`` can
            # poll it with MSG_DONTWAIT (Python's own timeout polls before every recv).
            self._sock.settimeout(None)
            limit = struct.pack("@ll", int(timeout_s), int(timeout_s % 1 * 1e6))
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
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
        """Store blocks; per key, whether this call gave the store its block.

        A key the store already holds, or that another client is writing, is skipped
        (``False``). All or nothing otherwise: ``StoreFullError`` stores none of them. The
        keys that fit the slots granted ahead (see ``begin_put``) are copied while the owner
        handles the request, so a put waits for the owner only for what did not fit, and
        the commit sends nothing (see ``PendingPut``).
        """
        if len(arrays) != len(keys):
            raise ValueError(f"{len(arrays)} arrays for {len(keys)} keys")
        if not self._granted:
            return self._put_reserved(keys, arrays, parent_hashes, token_ids)
        pending = self._start_put(keys, parent_hashes, token_ids)
        try:  # the arrays are checked while the owner handles the request
            checked = self._attachment.check_blocks(arrays, len(keys), out=False)
            for part in pending.parts:  # the claimed part first: no reply to wait for
                todo, slots = pending.write_plan(part)
                self._attachment.write_to(
                    slots, checked if part.whole and len(slots) == len(checked)
                    else [checked[i] for i in todo])
        except BaseException:
            with contextlib.suppress(ClientDetachedError):  # keep this error in front
                pending.abort()
            raise
        pending.commit()
        return pending.stored

    def _put_reserved(self, keys: Sequence[BlockKey], arrays: Sequence[Any],
                      parents: Sequence[int | None] | None,
                      tokens: Sequence[list[int] | None] | None) -> list[bool]:
        """``put_many`` without a grant (the common case once the store is full): reserve,
        copy, publish, in a straight line. What ``PendingPut`` does with parts, but a put is
        short enough next to its copy that a few calls per step show (measured)."""
        fields = self._put_fields(keys, parents, tokens)
        frame = _encode(Reserve(*fields, grant=self._want_grant(len(keys))))
        with self._lock:
            ticket = self._send(frame)
        attachment = self._attachment
        try:  # the arrays are checked while the owner handles the request
            checked = attachment.check_blocks(arrays, len(keys), out=False)
        except BaseException:
            with contextlib.suppress(BlockStoreError):  # keep this error in front
                self._abort_reserved(self._slots_reply(ticket, len(keys)))
            raise
        reply = self._slots_reply(ticket, len(keys))
        slots = reply.slots
        try:
            attachment.write_blocks(reply, checked)
        except BaseException:
            with contextlib.suppress(BlockStoreError):
                self._abort_reserved(reply)
            raise
        if not attachment.publish_filled(keys, slots, fields[1]):
            self._send_only(Publish(*descriptors(reply)))
        return [True] * len(slots) if None not in slots else [s is not None for s in slots]

    def _abort_reserved(self, reply: Slots) -> None:
        slots, generations = descriptors(reply)
        if slots:
            self._call(Abort(slots, generations), Done)

    def begin_put(
        self,
        keys: Sequence[BlockKey],
        *,
        parent_hashes: Sequence[int | None] | None = None,
        token_ids: Sequence[list[int] | None] | None = None,
    ) -> PendingPut:
        """Slots to fill in place (e.g. a device-to-host copy straight into them).

        Each put also asks the owner to grant this client as many slots ahead of its next
        put as its largest put so far (within the owner's cap, ``--grant-fraction``). The
        keys that fit the granted slots are claimed for them: their views are ready at once
        and the claim's reply is read at commit. The rest are reserved, which waits for the
        owner. When the client holds a grant, keys the read index shows held (where this
        client put or read them) are skipped without asking, so they take no granted slot.
        """
        pending = self._start_put(keys, parent_hashes, token_ids)
        try:
            pending.views  # noqa: B018 - waits for a reserved part's slots
        except BaseException:
            with contextlib.suppress(ClientDetachedError):  # keep this error in front
                pending.abort()
            raise
        return pending

    def _start_put(self, keys: Sequence[BlockKey], parents: Sequence[int | None] | None,
                   tokens: Sequence[list[int] | None] | None) -> PendingPut:
        """Send the put's requests (a ``Claim`` of granted slots for the keys they fit, a
        ``Reserve`` for the rest), waiting for no reply."""
        fields = self._put_fields(keys, parents, tokens)
        # Without a grant, the owner's reply skips held keys: no need to look first.
        held = self._attachment.known_held(keys) if self._granted else None
        whole = held is None or not any(held)
        todo: Sequence[int] = range(len(keys)) if whole else [
            i for i, known in enumerate(held) if not known]  # type: ignore[arg-type]
        n = len(todo)
        want = self._want_grant(n)
        with self._lock:
            granted, gens = self._granted, self._granted_gens
            cut = max(len(granted) - n, 0)
            slots, generations = granted[cut:], gens[cut:]
            del granted[cut:], gens[cut:]
        if not slots:  # the common case where the store is full: reserve everything
            requests: list[Claim | Reserve] = [Reserve(*_pick(fields, todo, whole), grant=want)]
            parts = [_Part(0, todo, None, whole)]
        else:
            claimed, reserved = todo[: len(slots)], todo[len(slots) :]
            ns, hs, ps, ts = _pick(fields, claimed, whole and not reserved)
            # The top-up rides on the reserve, if any: it must not take its room.
            requests = [Claim(ns, hs, slots, generations, ps, ts,
                              grant=0 if reserved else want)]
            parts = [_Part(0, claimed, slots, whole and not reserved)]
            if reserved:
                requests.append(Reserve(*_pick(fields, reserved, False), grant=want))
                parts.append(_Part(0, reserved, None))
        tickets = self._send_requests(requests)  # one write for both: one wake-up
        for part, ticket in zip(parts, tickets, strict=True):
            part.ticket = ticket
        return PendingPut(self, keys, parts)

    @staticmethod
    def _put_fields(keys: Sequence[BlockKey], parents: Sequence[int | None] | None,
                    tokens: Sequence[list[int] | None] | None) -> _Fields:
        """A put's namespaces, hashes, parents and tokens, as the wire carries them."""
        namespaces, hashes = split_keys(keys)
        if parents is not None and len(parents) != len(keys):
            raise ValueError(f"{len(parents)} parent_hashes for {len(keys)} keys")
        if tokens is not None and len(tokens) != len(keys):
            raise ValueError(f"{len(tokens)} token_ids for {len(keys)} keys")
        # Lists go as they are (encoded at once, never kept); other sequences are copied.
        return (namespaces, hashes,
                parents if parents is None or type(parents) is list else list(parents),
                tokens if tokens is None or type(tokens) is list else list(tokens))

    def _want_grant(self, count: int) -> int:
        """The grant to ask with a put of ``count`` keys: as many slots as the largest put."""
        want = self._grant_want
        if count <= want:  # the common case: no larger put than before (an int read is atomic)
            return want
        with self._lock:
            want = self._grant_want = max(self._grant_want, count)
        return want

    def _slots_reply(self, ticket: int, count: int) -> Slots:
        """The owner's ``Slots`` for a reserve or claim of ``count`` keys (taking the
        slots it granted ahead with it)."""
        reply = self._await_reply(ticket, Slots)
        if len(reply.slots) != count:
            raise ProtocolError(f"{len(reply.slots)} slots for {count} keys")
        self._add_grants(reply)
        return reply

    def _add_grants(self, reply: Slots) -> None:
        if reply.grant_slots:
            if len(reply.grant_slots) != len(reply.grant_generations):
                raise ProtocolError("a grant of slots without their generations")
            with self._lock:
                self._granted += reply.grant_slots
                self._granted_gens += reply.grant_generations

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
        if self._count_hits(hits) == len(hits):
            return hits
        rest = [i for i, hit in enumerate(hits) if not hit]
        for i, hit in zip(rest, self._get_leased([keys[i] for i in rest],
                                                 [checked[i] for i in rest]), strict=True):
            hits[i] = hit
        return hits

    def _count_hits(self, hits: list[bool]) -> int:
        """Count a read's optimistic hits in our cell (one writer at a time); how many."""
        found = hits.count(True)
        if found:
            with self._lock:
                self._attachment.count_hits(found)
        return found

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
            if self._count_hits(hits) == len(keys):
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
            reply = self._collect(self._send(frame))
        return expect(reply, kind)

    def _send_requests(self, requests: Sequence[Any]) -> list[int]:
        """Send requests in one write; their tickets, for ``_await_reply``. Replies come
        back in order, so a thread may send, work, then collect its replies while others
        make calls."""
        frames = b"".join(map(_encode, requests))
        with self._lock:
            last = self._send(frames, len(requests)) if frames else self._sent
        return list(range(last - len(requests) + 1, last + 1))

    def _await_reply(self, ticket: int, kind: type[R]) -> R:
        with self._lock:
            reply = self._collect(ticket)
        return expect(reply, kind)

    def _send(self, frame: bytes, count: int = 1) -> int:
        """(Lock held.) Send ``count`` request frames (joined); the last one's ticket."""
        self._write(frame)
        self._sent += count
        return self._sent

    def _write(self, frame: bytes) -> None:
        """(Lock held.) Write frames whole, or detach: a partial frame breaks the stream."""
        sock = self._live_socket()
        try:
            sock.sendall(frame)
        except OSError as exc:
            raise self._lost(exc) from exc
        except BaseException:
            self._detach()  # interrupted mid frame: the stream is out of step
            raise

    def _collect(self, ticket: int) -> Reply:
        """(Lock held.) The reply to ``ticket``, keeping replies read for other tickets."""
        reply = self._early.pop(ticket, None) if self._early else None
        while reply is None:
            sock = self._live_socket()
            try:
                got = self._recv(sock)
            except (OSError, ClientDetachedError) as exc:
                raise self._lost(exc) from exc
            except BaseException:
                self._detach()  # interrupted mid reply: the stream is out of step
                raise
            self._answered += 1
            if self._answered == ticket:
                reply = got
            else:  # another thread's: it collects it from here
                self._early[self._answered] = got
        return reply

    def _lost(self, exc: BaseException) -> ClientDetachedError:
        """(Lock held.) Detach after the socket failed; the error to raise, saying why (a
        kernel timeout reads as EAGAIN)."""
        self._detach()
        why = ("no answer within the client's timeout_s" if isinstance(exc, BlockingIOError)
               else str(exc))
        return ClientDetachedError(f"lost the block store owner on {self.socket_path}: {why}")

    def _send_only(self, request: Any) -> None:
        """Send a one-way frame (``Publish``, ``Release``): no ticket, no reply."""
        frame = _encode(request)
        with self._lock:
            self._write(frame)

    def _live_socket(self) -> socket.socket:
        if self._sock is None:
            raise ClientDetachedError(f"the client of {self.socket_path} is closed")
        return self._sock

    def _recv(self, sock: socket.socket) -> Reply:
        buf = self._buf
        if not buf:  # the common case: one recv brings exactly one whole reply
            chunk = self._recv_spinning(sock) if self._spin_s else sock.recv(1 << 16)
            if not chunk:
                raise ClientDetachedError("the owner closed the connection")
            if len(chunk) >= 4 and len(chunk) == 4 + frame_length(chunk):
                return decode_reply(memoryview(chunk)[4:])
            buf += chunk
        while len(buf) < 4:
            self._fill(sock, buf)
        length = frame_length(buf)
        while len(buf) < 4 + length:
            self._fill(sock, buf)
        body = bytes(buf[4 : 4 + length])
        del buf[: 4 + length]
        return decode_reply(body)

    def _recv_spinning(self, sock: socket.socket) -> bytes:
        """``recv``, busy-waiting up to ``spin_us`` before sleeping: a reply comes within
        about a hundred µs, and a thread woken from sleep on another CPU than the owner's
        pays tens of µs more in a VM (the socket blocks, with kernel timeouts)."""
        deadline = time.perf_counter() + self._spin_s
        while True:
            try:
                return sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() > deadline:
                    return sock.recv(1 << 16)
                os.sched_yield()  # the owner may be waiting for this very CPU

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
        self._granted, self._granted_gens = [], []  # the owner frees them with our session

    def close(self) -> None:
        """Close the socket (the owner releases what we held) and unmap; idempotent."""
        with self._lock:
            self._detach()
        self._attachment.close()

    def __enter__(self) -> BlockStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_Fields = tuple[list[int], list[int], list[int | None] | None, list[list[int] | None] | None]
"""A put's namespaces, hashes, parents and tokens (``BlockStoreClient._put_fields``)."""


def _pick(fields: _Fields, indices: Sequence[int], whole: bool) -> _Fields:
    """The namespaces, hashes, parents and tokens of the keys at ``indices`` (``whole``:
    every key, in order: taken as they are)."""
    if whole:
        return fields
    return tuple(  # type: ignore[return-value]
        None if values is None else [values[i] for i in indices] for values in fields)


def _encode(request: Any) -> bytes:
    try:
        return encode(request)
    except (OverflowError, TypeError) as exc:  # e.g. a block hash of 2**64 or more
        raise ValueError(
            f"{type(request).__name__} request holds a value the control channel cannot "
            f"carry (keys are pairs of unsigned 64-bit integers): {exc}"
        ) from exc
