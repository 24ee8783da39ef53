"""One client connection of the owner: one store session, its frames handled in order.

A connection's one-way frames (``Release``, ``Publish``) are handled as soon as they are
read; a request that needs a reply waits its turn (``ConnectionOwner.wait_turn``) until
every connection readable in the same wake-up has been read, so whatever one-way frame
reached the owner before a request was sent, on any connection, is applied before that
request. Replies go out as soon as each is made, before the owner's bookkeeping.

A reply the owner defers (a lease that reads the disk tier: ``BlockStoreOwner.handle``'s
task) holds the connection's later frames, one-way ones included, until it is sent, so
replies keep their order; other connections are served meanwhile.
"""

from __future__ import annotations

import asyncio
from typing import Protocol, cast

import structlog

from shm.errors import BlockStoreError, ProtocolError
from shm.owner.store import SessionId
from shm.protocol import ErrorReply, FrameReader, encode, is_one_way

__all__ = ["Connection", "ConnectionOwner"]

log = structlog.get_logger(component="shm")


class ConnectionOwner(Protocol):
    """What a connection asks of its owner (``shm.owner.server.BlockStoreOwner``)."""

    def handle(self, session: SessionId, body: bytes, *, drain: bool = True,
               defer: bool = False) -> bytes | asyncio.Task[bytes] | None:
        ...

    def wait_turn(self, conn: Connection) -> bool: ...

    def drain_events(self) -> None: ...

    def session_opened(self, conn: Connection) -> SessionId: ...

    def session_closed(self, conn: Connection, session: SessionId) -> None: ...


class Connection(asyncio.Protocol):
    """One client connection = one store session."""

    def __init__(self, owner: ConnectionOwner) -> None:
        self._owner = owner
        self._reader = FrameReader()
        self._transport: asyncio.Transport | None = None
        self._session: SessionId | None = None
        self._queued: list[bytes] = []  # a request and what followed it, awaiting our turn
        self._deferred: asyncio.Task[bytes] | None = None  # a reply the owner still makes

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self._session = self._owner.session_opened(self)

    def data_received(self, data: bytes) -> None:
        assert self._transport is not None and self._session is not None
        try:
            bodies = self._reader.feed(data)
        except ProtocolError as exc:
            log.warning("shm_client_dropped", session=self._session, error=str(exc))
            self._transport.write(encode(ErrorReply(exc.code, str(exc))))
            self._transport.close()
            return
        if self._queued or self._deferred is not None:  # waiting: keep the order
            self._queued += bodies
            return
        handle, session = self._owner.handle, self._session
        for i, body in enumerate(bodies):
            if not is_one_way(body):
                self._queued = bodies[i:]
                if not self._owner.wait_turn(self):
                    self.run_queued()
                return
            handle(session, body)  # one-way: nobody waits, drain at once

    def run_queued(self) -> None:
        """Handle the queued frames in order, sending each reply as soon as it is made."""
        bodies, self._queued = self._queued, []
        if self._session is None or not bodies:
            return
        owner, session = self._owner, self._session
        for i, body in enumerate(bodies):  # reply first: the listener's work is not on the
            reply = owner.handle(session, body, drain=False, defer=True)  # round trip
            if isinstance(reply, asyncio.Task):
                self._queued = bodies[i + 1 :]
                self._deferred = reply
                reply.add_done_callback(self._send_deferred)
                owner.drain_events()
                return
            self._send(reply)
            owner.drain_events()

    def _send(self, reply: bytes | None) -> None:
        if reply and self._transport is not None and not self._transport.is_closing():
            self._transport.write(reply)

    def _send_deferred(self, task: asyncio.Task[bytes]) -> None:
        """The deferred reply is made: send it, then handle what waited behind it."""
        self._deferred = None
        if task.cancelled():
            reply = encode(ErrorReply("client_detached", "the owner is shutting down"))
        elif (exc := task.exception()) is not None:
            log.error("shm_deferred_reply_failed", session=self._session, error=repr(exc))
            reply = encode(ErrorReply(BlockStoreError.code, f"internal error: {exc!r}"))
        else:
            reply = task.result()
        self._send(reply)
        if self._session is not None:
            self.run_queued()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._session is not None:
            if self._deferred is None:
                self.run_queued()  # e.g. a Publish sent just before the client exited
            else:  # nobody reads the replies: apply what the client sent one-way
                queued, self._queued = self._queued, []
                for body in queued:
                    if is_one_way(body):
                        self._owner.handle(self._session, body)
            self._owner.session_closed(self, self._session)
            self._session = None

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()
