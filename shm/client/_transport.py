"""How a client's requests reach the owner and its replies come back: one transport.

The control channel pairs replies with requests first in, first out (``shm.protocol``).
``Channel`` holds what every client connection shares and does no I/O of its own: encoding
a request (a value the wire cannot carry is a ``ValueError``), splitting the byte stream
into replies, pairing each reply with its request's ticket, and the errors (an
``ErrorReply`` becomes its exception in ``expect``; a failed connection detaches and
becomes ``ClientDetachedError``, saying why). Two thin shells move the bytes:

* ``SocketChannel``: a blocking socket, for engine threads (``BlockStoreClient``). Thread
  safe: each request takes a ticket, so a thread can send, copy, and only then collect its
  reply while other threads make calls; it busy-waits a little for a reply before it
  sleeps (see ``_recv_spinning``).
* ``StreamChannel``: an asyncio stream, for the sidecar (``AsyncBlockStoreClient``,
  ``AsyncSegmentReader``). One request is in flight at a time; a call cancelled between
  its request and its reply drops the connection, which would otherwise be out of step.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, TypeVar

from shm.errors import ClientDetachedError, ProtocolError, error_from_code
from shm.protocol import (
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    Reply,
    Welcome,
    decode_reply,
    encode,
    frame_length,
)

__all__ = ["Channel", "SocketChannel", "StreamChannel", "encode_request", "expect", "hello"]

R = TypeVar("R")
_READ_BYTES = 1 << 16


def expect(reply: Reply, kind: type[R]) -> R:
    """``reply`` if it is a ``kind``; the error it carries, or ``ProtocolError``, if not."""
    if isinstance(reply, kind):
        return reply
    if isinstance(reply, ErrorReply):
        raise error_from_code(reply.code, reply.message)
    raise ProtocolError(f"expected a {kind.__name__} reply, got {type(reply).__name__}")


def encode_request(request: Any) -> bytes:
    """One request frame; ``ValueError`` for a value the control channel cannot carry."""
    try:
        return encode(request)
    except (OverflowError, TypeError) as exc:  # e.g. a block hash of 2**64 or more
        raise ValueError(
            f"{type(request).__name__} request holds a value the control channel cannot "
            f"carry (keys are pairs of unsigned 64-bit integers): {exc}"
        ) from exc


class Channel(ABC):
    """One connection's frames, tickets and errors, without I/O (see the module docstring)."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._buf = bytearray()  # bytes read past the last whole reply
        self._sent = self._answered = 0  # request tickets sent, replies read
        self._early: dict[int, Reply] = {}  # replies read before their caller asked

    @property
    @abstractmethod
    def closed(self) -> bool: ...

    @abstractmethod
    def _detach(self) -> None:
        """Close the connection at once (the owner then frees what it held for us)."""

    def _next_reply(self, chunk: bytes) -> Reply | None:
        """Take ``chunk`` read from the connection (empty: the owner closed it); the next
        whole reply, or ``None`` until more bytes come."""
        if not chunk:
            raise ClientDetachedError("the owner closed the connection")
        buf = self._buf
        if not buf and len(chunk) >= 4 and len(chunk) == 4 + frame_length(chunk):
            return decode_reply(memoryview(chunk)[4:])  # the common case: one read, one reply
        buf += chunk
        return self._buffered()

    def _buffered(self) -> Reply | None:
        """The next whole reply among the bytes already read, if any."""
        buf = self._buf
        if len(buf) < 4:
            return None
        length = frame_length(buf)
        if len(buf) < 4 + length:
            return None
        body = bytes(buf[4 : 4 + length])
        del buf[: 4 + length]
        return decode_reply(body)

    def _answers(self, ticket: int, reply: Reply) -> bool:
        """Count a reply read; whether it answers ``ticket`` (else it is kept for the
        caller whose it is)."""
        self._answered += 1
        if self._answered == ticket:
            return True
        self._early[self._answered] = reply
        return False

    def _lost(self, exc: BaseException) -> ClientDetachedError:
        """Detach after the connection failed; the error to raise, saying why (a kernel
        timeout reads as EAGAIN)."""
        self._detach()
        why = ("no answer within the client's timeout_s"
               if isinstance(exc, BlockingIOError | TimeoutError) else str(exc) or repr(exc))
        return ClientDetachedError(f"lost the block store owner on {self.socket_path}: {why}")

    def _closed_error(self) -> ClientDetachedError:
        return ClientDetachedError(f"the client of {self.socket_path} is closed")


def hello() -> Hello:
    """The first request of every connection."""
    return Hello(PROTOCOL_VERSION, os.getpid())


class SocketChannel(Channel):
    """A blocking connection to the owner (see the module docstring)."""

    def __init__(self, socket_path: str, *, timeout_s: float, spin_us: float) -> None:
        """Connect; ``timeout_s`` bounds the connect, each send and each wait for a reply,
        ``spin_us`` how long a wait busy-waits before it sleeps (0: never)."""
        super().__init__(socket_path)
        self._lock = threading.Lock()
        self._spin_s = spin_us / 1e6
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout_s)
            self._sock.connect(socket_path)
            # Then a blocking socket with kernel timeouts, so that ``_recv_spinning`` can
            # poll it with MSG_DONTWAIT (Python's own timeout polls before every recv).
            self._sock.settimeout(None)
            limit = struct.pack("@ll", int(timeout_s), int(timeout_s % 1 * 1e6))
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
        except BaseException:
            self._detach()
            raise

    @property
    def closed(self) -> bool:
        return self._sock is None

    def call(self, request: Any, kind: type[R]) -> R:
        """Send ``request`` and wait for its reply, a ``kind``."""
        frame = encode_request(request)
        with self._lock:
            self._write(frame)
            self._sent += 1
            reply = self._collect(self._sent)
        return expect(reply, kind)

    def send(self, request: Any) -> int:
        """Send ``request``; its ticket, for ``reply``."""
        frame = encode_request(request)
        with self._lock:
            self._write(frame)
            self._sent += 1
            return self._sent

    def send_all(self, requests: Sequence[Any]) -> list[int]:
        """Send requests in one write (one wake-up of the owner); their tickets."""
        frames = b"".join(map(encode_request, requests))
        with self._lock:
            if frames:
                self._write(frames)
                self._sent += len(requests)
            last = self._sent
        return list(range(last - len(requests) + 1, last + 1))

    def reply(self, ticket: int, kind: type[R]) -> R:
        """The reply to the request of ``ticket``, a ``kind`` (waits for it)."""
        with self._lock:
            reply = self._collect(ticket)
        return expect(reply, kind)

    def send_only(self, request: Any) -> None:
        """Send a one-way frame (``Publish``, ``Release``): no ticket, no reply."""
        frame = encode_request(request)
        with self._lock:
            self._write(frame)

    def close(self) -> None:
        with self._lock:
            self._detach()

    def _write(self, frame: bytes) -> None:
        """(Lock held.) Write frames whole, or detach: a partial frame breaks the stream."""
        sock = self._sock
        if sock is None:
            raise self._closed_error()
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
            sock = self._sock
            if sock is None:
                raise self._closed_error()
            try:
                got = self._buffered() if self._buf else None
                while got is None:
                    got = self._next_reply(
                        self._recv_spinning(sock) if self._spin_s else sock.recv(_READ_BYTES))
            except (OSError, ClientDetachedError) as exc:
                raise self._lost(exc) from exc
            except BaseException:
                self._detach()  # interrupted mid reply: the stream is out of step
                raise
            if self._answers(ticket, got):
                reply = got
        return reply

    def _recv_spinning(self, sock: socket.socket) -> bytes:
        """``recv``, busy-waiting up to ``spin_us`` before sleeping: a reply comes within
        about a hundred µs, and a thread woken from sleep on another CPU than the owner's
        pays tens of µs more in a VM (the socket blocks, with kernel timeouts)."""
        deadline = time.perf_counter() + self._spin_s
        while True:
            try:
                return sock.recv(_READ_BYTES, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() > deadline:
                    return sock.recv(_READ_BYTES)
                os.sched_yield()  # the owner may be waiting for this very CPU

    def _detach(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class StreamChannel(Channel):
    """An asyncio connection to the owner; build with ``await StreamChannel.open(...)``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 socket_path: str, timeout_s: float) -> None:
        super().__init__(socket_path)
        self._reader = reader
        self._writer: asyncio.StreamWriter | None = writer
        self._lock = asyncio.Lock()
        self.timeout_s = timeout_s

    @classmethod
    async def open(cls, socket_path: str | os.PathLike[str], *,
                   timeout_s: float) -> tuple[StreamChannel, Welcome]:
        """Connect and say hello; the channel and the owner's welcome. ``timeout_s`` bounds
        the connect and each wait for a reply."""
        path = os.fspath(socket_path)
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_unix_connection(path)
        channel = cls(reader, writer, socket_path=path, timeout_s=timeout_s)
        try:
            welcome = await channel.call(hello(), Welcome)
        except BaseException:
            channel._detach()
            raise
        return channel, welcome

    @property
    def closed(self) -> bool:
        return self._writer is None or self._writer.is_closing()

    async def call(self, request: Any, kind: type[R]) -> R:
        """Send ``request`` and await its reply, a ``kind``."""
        frame = encode_request(request)
        async with self._lock:
            writer = self._live_writer()
            try:
                writer.write(frame)
                self._sent += 1
                async with asyncio.timeout(self.timeout_s):
                    reply = await self._collect(self._sent)
            except (OSError, TimeoutError, ClientDetachedError) as exc:
                raise self._lost(exc) from exc
            except BaseException:
                # Cancelled between request and reply: the late reply would pair with the
                # next request, so drop the connection (the owner frees what it held).
                self._detach()
                raise
        return expect(reply, kind)

    def send_only(self, request: Any) -> None:
        """Send a one-way frame (``Publish``, ``Release``): no reply to wait for."""
        self._live_writer().write(encode_request(request))

    async def _collect(self, ticket: int) -> Reply:
        """(Lock held.) The reply to ``ticket``."""
        reply = self._early.pop(ticket, None) if self._early else None
        while reply is None:
            got = self._buffered() if self._buf else None
            while got is None:
                got = self._next_reply(await self._reader.read(_READ_BYTES))
            if self._answers(ticket, got):
                reply = got
        return reply

    def _live_writer(self) -> asyncio.StreamWriter:
        if self._writer is None or self._writer.is_closing():
            raise self._closed_error()
        return self._writer

    def _detach(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def aclose(self) -> None:
        """Close the connection (the owner releases what we held); idempotent."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):  # the owner went away: nothing to flush
                await writer.wait_closed()
