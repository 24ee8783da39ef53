"""A put's in-place forms, and the one way every put commits.

A put reserves slots for its keys (or claims slots granted ahead: the blocking client's
``begin_put``), copies the blocks in, then commits the one way every client commits:
``Attachment.commit_filled`` publishes the slots in the read index, which commits them
with no message (``shm.read_index``), or, for a client that does not read
optimistically, yields the one-way ``Publish`` to send. Either way the blocks are visible
to every request sent after the commit returns (``shm.protocol`` says why).

``PendingPut`` (blocking) and ``AsyncPendingPut`` (asyncio) hand out the slots to fill in
place, e.g. a device-to-host copy or a transfer received straight into them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

import numpy as np

import shm.client._requests as req
from shm.client._attachment import Attachment
from shm.client._transport import SocketChannel, StreamChannel
from shm.errors import BlockStoreError, ClientDetachedError
from shm.owner.store import BlockKey
from shm.protocol import Abort, Done, Slots

__all__ = ["AsyncPendingPut", "Part", "PendingPut"]


@dataclass(slots=True)
class Part:
    """Some of a put's keys, sent in one request whose reply may not be read yet."""

    ticket: int
    todo: Sequence[int]  # key indices
    claimed_slots: list[int] | None  # a claim's granted slots, one per key; None: reserved
    whole: bool = False  # todo is every key of the put, in order
    reply: Slots | None = None
    error: BlockStoreError | None = None  # the owner's error reply, e.g. StoreFullError


class PendingPut:
    """Slots for a put: write ``views`` in place, then ``commit()`` (or ``abort()``).

    ``views[i]`` is a writable uint8 view of the slot for key ``i``, or ``None`` when the
    store already holds (or is being given) that key. Nothing is visible to readers until
    commit; after ``commit()`` or ``abort()`` the views must not be written (or kept) any
    more. ``commit()`` waits for no owner (see the module docstring).

    A put's keys go in up to two parts: those that fit the slots granted to the client
    ahead, claimed for them (the ``Claim`` is on its way while the caller writes), and the
    rest, reserved (the owner answered before the views were handed out). A key the owner
    finds held while it handles the claim keeps a view that is written for nothing;
    ``stored``, read after the writes, says which keys took.
    """

    def __init__(self, channel: SocketChannel, attachment: Attachment,
                 answer: Callable[[int, int], Slots], keys: Sequence[BlockKey],
                 parts: list[Part]) -> None:
        """``answer(ticket, count)``: the client's read of a reserve's or claim's reply."""
        self._channel = channel
        self._attachment = attachment
        self._read_answer = answer
        self._keys = keys
        self.parts = parts  # claimed part first: its slots are known at once
        self._views: list[np.ndarray | None] | None = None  # made on first use
        self._open = True
        self._aborted = False

    @property
    def views(self) -> list[np.ndarray | None]:
        if self._views is None:
            views: list[np.ndarray | None] = [None] * len(self._keys)
            rows = self._attachment.rows()
            for part in self.parts:
                for i, slot in zip(*self.write_plan(part), strict=True):
                    views[i] = rows[slot]
            self._views = views
        return self._views

    def write_plan(self, part: Part) -> tuple[Sequence[int], Sequence[int]]:
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

    def _answer(self, part: Part) -> Slots:
        if part.error is not None:
            raise part.error
        if part.reply is None:
            try:
                part.reply = self._read_answer(part.ticket, len(part.todo))
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
        for part, reply in zip(self.parts, replies, strict=True):
            keys = self._keys if part.whole else [self._keys[i] for i in part.todo]
            publish = self._attachment.commit_filled(keys, reply)
            if publish is not None:
                self._channel.send_only(publish)

    def abort(self) -> None:
        if not self._open:
            return
        self._open = False
        self._aborted = True
        slots: list[int] = []
        generations: list[int] = []
        for part in self.parts:  # collect every reply, even past a failed reserve
            try:
                part_slots, part_generations = req.descriptors(self._answer(part))
            except BlockStoreError:  # e.g. StoreFullError: that part holds nothing
                continue
            slots += part_slots
            generations += part_generations
        if slots:
            self._channel.call(Abort(slots, generations), Done)

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


class AsyncPendingPut:
    """Reserved slots to fill in place (e.g. a transfer received straight into them).

    ``views[i]`` is a writable uint8 view of key ``i``'s slot, or ``None`` when the store
    already holds (or is being given) that key. ``async with`` commits on success and aborts
    on error; after either, the views must not be written or kept. The commit waits for no
    owner (see the module docstring).
    """

    def __init__(self, channel: StreamChannel, attachment: Attachment,
                 keys: Sequence[BlockKey], reply: Slots) -> None:
        self._channel = channel
        self._attachment = attachment
        self._keys = keys
        self._reply = reply
        self.views = attachment.views(reply, writable=True)
        self.stored = [s is not None for s in reply.slots]
        self._open = True

    async def commit(self) -> None:
        if self._open:
            self._open = False
            publish = self._attachment.commit_filled(self._keys, self._reply)
            if publish is not None:
                self._channel.send_only(publish)

    async def abort(self) -> None:
        if self._open:
            self._open = False
            abort = req.abort(self._reply)
            if abort is not None:
                await self._channel.call(abort, Done)

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
