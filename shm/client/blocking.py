"""The blocking client, for engine threads: one socket, one mapping, thread-safe.

    with BlockStoreClient("/run/kv/store.sock") as store:
        store.put_many(keys, arrays)       # copy over a standby grant taken in the read
                                           # index (no message at all), or into slots
                                           # granted ahead while claiming them, or reserve
                                           # first; then publish them in the read index:
                                           # that commits, no message
        hits = store.get_many(keys, outs)  # through the read index, or lease → copy → release

Keys are ``(namespace_seed, block_hash)`` pairs. Arrays are numpy arrays or torch tensors
of exactly one block (see ``shm.client._blocks``). Block bytes never cross the socket: one small
frame per batch asks for slots, and the copy goes straight to or from the mapped segment.

Requests and replies pair first-in first-out; each request takes a ticket
(``shm.client._transport.SocketChannel``), so a thread can send a ``Claim``, copy, and only then
collect its reply while other threads make calls.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

import shm.client._requests as req
from shm.client._attachment import Attachment
from shm.client._puts import Part, PendingPut
from shm.client._transport import SocketChannel, hello
from shm.errors import BlockStoreError, ClientDetachedError, ProtocolError, UnknownBlockError
from shm.owner.store import BlockKey, StoreStats
from shm.protocol import Claim, Done, Flags, Reserve, Slots, StatsReply, Welcome

__all__ = ["BlockStoreClient", "PendingPut"]


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
        the mapping for CUDA, so GPU copies DMA straight to it (see ``shm.client._cuda``).
        ``spin_us``: how long a call busy-waits for its reply before it sleeps (0: never);
        ``timeout_s`` bounds each send and each wait for a reply."""
        if not timeout_s > 0 or spin_us < 0:
            raise ValueError(f"timeout_s must be > 0 and spin_us >= 0, got {timeout_s}, "
                             f"{spin_us}")
        self.socket_path = Path(socket_path)
        self._lock = threading.Lock()  # the grant and the hit count, not the socket
        # Slots granted ahead and not used yet, and their generations (parallel lists).
        self._granted: list[int] = []
        self._granted_gens: list[int] = []
        self._grant_want = 0  # granted slots to keep: the largest put so far
        channel = self._channel = SocketChannel(str(self.socket_path), timeout_s=timeout_s,
                                                spin_us=spin_us)
        # The channel's own methods, bound once: no extra call on any request's path.
        self._call = channel.call
        self._send_only = channel.send_only
        try:
            welcome = self._call(hello(), Welcome)
            self._attachment = Attachment(welcome, expected_owner_id,
                                          optimistic_reads=optimistic_reads,
                                          register_cuda=register_cuda)
        except BaseException:
            channel.close()
            raise
        self.welcome = welcome
        # Whether our puts can take standby grants: then their reserves ask for one.
        self._standby_ok = self._attachment.takes_standby
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

    def put_many(self, keys: Sequence[BlockKey], arrays: Sequence[Any], *,
                 parent_hashes: req.Parents = None, token_ids: req.Tokens = None) -> list[bool]:
        """Store blocks; per key, whether this call gave the store its block.

        A key the store already holds, or that another client is writing, is skipped
        (``False``). All or nothing otherwise: ``StoreFullError`` stores none of them. The
        keys that fit the slots granted ahead (see ``begin_put``) are copied while the owner
        handles the request, so a put waits for the owner only for what did not fit, and
        the commit sends nothing (see ``PendingPut``). Once the store is full, a put
        without ``token_ids`` usually sends nothing at all: it overwrites blocks the owner
        offered ahead (``shm.owner.store.standby``).
        """
        if len(arrays) != len(keys):
            raise ValueError(f"{len(arrays)} arrays for {len(keys)} keys")
        if token_ids is None:  # over a standby grant, if the owner offers one
            stored = self._put_standby(keys, arrays, parent_hashes)
            if stored is not None:
                return stored
        if not self._granted:
            return self._put_reserved(keys, arrays, parent_hashes, token_ids)
        pending = self._start_put(keys, parent_hashes, token_ids, token_ids is None)
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

    def _put_standby(self, keys: Sequence[BlockKey], arrays: Sequence[Any],
                     parents: req.Parents) -> list[bool] | None:
        """``put_many`` over our standby grant (``shm.owner.store.standby``), sending nothing:
        take it, retract the slots we overwrite, copy, then record, publish and mark it
        done in the read index, where the owner picks it up. ``None``: no grant offered
        big enough, so the put reserves. Keys the read index shows held are skipped; a
        key another client gave the store meanwhile is kept once (ours may be the copy
        dropped, though this says True)."""
        attachment = self._attachment
        with self._lock:  # one put at a time takes the grant
            grant = attachment.take_standby(len(keys))
        if grant is None:
            return None
        epoch, slots = grant
        held = attachment.known_held(keys)
        whole = held is None or not any(held)
        todo: Sequence[int] = range(len(keys)) if whole else [
            i for i, known in enumerate(held) if not known]  # type: ignore[arg-type]
        if not whole:  # keep the blocks of the keys we skip as held
            busy = attachment.hinted_slots([key for key, known in zip(keys, held, strict=True)  # type: ignore[arg-type]
                                            if known])
            slots = [slot for slot in slots if slot not in busy]
        slots = slots[: len(todo)]  # the rest of the grant: left as it is
        try:
            checked = attachment.check_blocks(arrays, len(keys), out=False)
            fields = req.put_fields(keys, parents, None)
            attachment.retract(slots)  # odd before the first byte changes: readers miss
            attachment.write_to(slots, checked if whole else [checked[i] for i in todo])
        except BaseException:  # hand the grant back (retracted slots are freed)
            with contextlib.suppress(BlockStoreError):
                attachment.overwritten(epoch, [], [], None, None)
            raise
        _, hs, ps, _ = fields if whole else req.pick(fields, todo, False)
        attachment.overwritten(epoch, keys if whole else [keys[i] for i in todo], slots, hs, ps)
        return [True] * len(keys) if whole else [not known for known in held]  # type: ignore[union-attr]

    def _put_reserved(self, keys: Sequence[BlockKey], arrays: Sequence[Any],
                      parents: req.Parents, tokens: req.Tokens) -> list[bool]:
        """``put_many`` without a grant (the common case once the store is full): reserve,
        copy, publish, in a straight line. What ``PendingPut`` does with parts, but a put is
        short enough next to its copy that a few calls per step show (measured)."""
        fields = req.put_fields(keys, parents, tokens)
        ticket = self._channel.send(Reserve(*fields, grant=self._want_grant(len(keys)),
                                            standby=tokens is None and self._standby_ok))
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
        publish = attachment.commit_filled(keys, reply, fields[1])
        if publish is not None:
            self._send_only(publish)
        return [True] * len(slots) if None not in slots else [s is not None for s in slots]

    def _abort_reserved(self, reply: Slots) -> None:
        abort = req.abort(reply)
        if abort is not None:
            self._call(abort, Done)

    def begin_put(self, keys: Sequence[BlockKey], *, parent_hashes: req.Parents = None,
                  token_ids: req.Tokens = None) -> PendingPut:
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

    def _start_put(self, keys: Sequence[BlockKey], parents: req.Parents,
                   tokens: req.Tokens, standby: bool = False) -> PendingPut:
        """Send the put's requests (a ``Claim`` of granted slots for the keys they fit, a
        ``Reserve`` for the rest), waiting for no reply. ``standby``: a ``put_many`` that
        could take a standby grant (its reserve asks for one)."""
        standby = standby and self._standby_ok
        fields = req.put_fields(keys, parents, tokens)
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
            requests: list[Claim | Reserve] = [
                Reserve(*req.pick(fields, todo, whole), grant=want, standby=standby)]
            parts = [Part(0, todo, None, whole)]
        else:
            claimed, reserved = todo[: len(slots)], todo[len(slots) :]
            ns, hs, ps, ts = req.pick(fields, claimed, whole and not reserved)
            # The top-up rides on the reserve, if any: it must not take its room.
            requests = [Claim(ns, hs, slots, generations, ps, ts,
                              grant=0 if reserved else want)]
            parts = [Part(0, claimed, slots, whole and not reserved)]
            if reserved:
                requests.append(Reserve(*req.pick(fields, reserved, False), grant=want,
                                        standby=standby))
                parts.append(Part(0, reserved, None))
        tickets = self._channel.send_all(requests)  # one write for both: one wake-up
        for part, ticket in zip(parts, tickets, strict=True):
            part.ticket = ticket
        return PendingPut(self._channel, self._attachment, self._slots_reply, keys, parts)

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
        reply = self._channel.reply(ticket, Slots)
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
        reply = self._call(req.lease(keys), Slots)
        self._attachment.remember(keys, reply)
        try:
            self._attachment.read_blocks(reply, checked)
        finally:
            release = req.release(reply)
            if release is not None:
                self._send_only(release)
        return [s is not None for s in reply.slots]

    @contextmanager
    def leased(self, keys: Sequence[BlockKey]) -> Iterator[list[np.ndarray | None]]:
        """Read-only views of the held blocks (``None`` if absent), valid inside the block."""
        reply = self._call(req.lease(keys), Slots)
        self._attachment.remember(keys, reply)
        try:
            yield self._attachment.views(reply, writable=False)
        finally:
            release = req.release(reply)
            if release is not None and not self._channel.closed:
                self._send_only(release)

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
        return self._call(req.contains(keys), Flags).values

    def remove_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Drop blocks from the store; per key, whether it was held."""
        return self._call(req.remove(keys), Flags).values

    def stats(self) -> StoreStats:
        return self._call(req.STATS, StatsReply).stats

    def ping(self) -> None:
        self._call(req.PING, Done)

    def close(self) -> None:
        """Close the socket (the owner releases what we held) and unmap; idempotent."""
        self._channel.close()
        with self._lock:
            self._granted, self._granted_gens = [], []  # the owner frees them with our session
        self._attachment.close()

    def __enter__(self) -> BlockStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
