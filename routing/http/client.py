"""Keep-alive connections to workers: a callback-driven HTTP/1.1 client protocol and its pool.

A request is written on an idle pooled connection when there is one (no task, no await);
otherwise the caller awaits ``UpstreamPool.connect``. Response events go straight to the
connection's current ``Receiver``: the head, body pieces (one batch per socket read, so the
relay writes once per read), completion, or loss of the connection. A connection whose
response completed with keep-alive goes back to the pool (LIFO, bounded per worker).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Protocol

import httptools

__all__ = ["Receiver", "UpstreamConnection", "UpstreamPool", "simple_request"]


class Receiver(Protocol):
    """Whoever waits for the response on an upstream connection."""

    def upstream_head(
        self, status: int, content_type: bytes, content_length: int | None
    ) -> None: ...
    def upstream_body(self, pieces: list[bytes]) -> None: ...
    def upstream_complete(self) -> None: ...
    def upstream_lost(self, exc: Exception | None, got_head: bool) -> None: ...


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to one worker."""

    __slots__ = (
        "_chunked",
        "_content_length",
        "_content_type",
        "_got_head",
        "_parser",
        "_paused",
        "_pieces",
        "closed",
        "key",
        "kv_pull",
        "pool",
        "receiver",
        "requests_sent",
        "transport",
    )

    def __init__(self, pool: UpstreamPool, key: str) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.receiver: Receiver | None = None
        self._pieces: list[bytes] = []
        self._content_type = b""
        self._content_length: int | None = None
        self._chunked = False
        self._got_head = False
        self.kv_pull: bytes | None = None  # the answer's x-kvsidecar-kv-pull, if any
        self.closed = False
        self._paused = False
        self.requests_sent = 0

    # --- use ---------------------------------------------------------------------------

    def send(self, receiver: Receiver, data: bytes) -> None:
        self.receiver = receiver
        self.requests_sent += 1
        self.transport.write(data)  # type: ignore[union-attr]

    def detach(self) -> None:
        """Abandon the in-flight request: the connection is closed, never reused."""
        self.receiver = None
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.discard(self)
            if self.transport is not None:
                self.transport.abort()

    def pause_reading(self) -> None:
        if not self.closed and not self._paused:
            self._paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]

    def resume_reading(self) -> None:
        if not self.closed and self._paused:
            self._paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]

    # --- asyncio callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            receiver, self.receiver = self.receiver, None
            self.close()
            if receiver is not None:
                receiver.upstream_lost(exc, self._got_head)
            return
        if self._pieces and self.receiver is not None:
            pieces, self._pieces = self._pieces, []
            self.receiver.upstream_body(pieces)

    def connection_lost(self, exc: Exception | None) -> None:
        was_closed = self.closed
        self.closed = True
        if not was_closed:
            self.pool.discard(self)
        receiver, self.receiver = self.receiver, None
        if receiver is None:
            return
        if self._pieces:
            pieces, self._pieces = self._pieces, []
            receiver.upstream_body(pieces)
        if self._got_head and self._content_length is None and not self._chunked and exc is None:
            # A close-delimited body (neither length nor chunked) ends with the connection;
            # a chunked one that ends before its last chunk was cut (the worker died).
            receiver.upstream_complete()
        else:
            receiver.upstream_lost(exc, self._got_head)

    # --- httptools callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        self._content_type = b""
        self._content_length = None
        self._chunked = False
        self._got_head = False
        self.kv_pull = None

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-type":
            self._content_type = value
        elif lower == b"content-length":
            self._content_length = int(value)
        elif lower == b"transfer-encoding":
            self._chunked = b"chunked" in value.lower()
        elif lower == b"x-kvsidecar-kv-pull":
            self.kv_pull = value  # a moved prefix's pull, as the sidecar reports it

    def on_headers_complete(self) -> None:
        self._got_head = True
        if self.receiver is not None:
            self.receiver.upstream_head(
                self._parser.get_status_code(), self._content_type, self._content_length
            )

    def on_body(self, body: bytes) -> None:
        self._pieces.append(body)

    def on_message_complete(self) -> None:
        receiver, self.receiver = self.receiver, None
        if receiver is None:
            return
        if self._pieces:
            pieces, self._pieces = self._pieces, []
            receiver.upstream_body(pieces)
        if self._parser.should_keep_alive():
            self.resume_reading()
            self.pool.release(self)
        else:
            self.close()
        receiver.upstream_complete()


class UpstreamPool:
    """Idle keep-alive connections per worker."""

    def __init__(self, max_idle_per_worker: int, connect_timeout_s: float) -> None:
        self.max_idle_per_worker = max_idle_per_worker
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[str, list[UpstreamConnection]] = {}
        self._open: set[UpstreamConnection] = set()
        self.connects = 0

    def take_idle(self, key: str) -> UpstreamConnection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    async def connect(self, key: str, host: str, port: int) -> UpstreamConnection:
        """A new connection (raises OSError or TimeoutError)."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(
                lambda: UpstreamConnection(self, key), host, port
            )
        self.connects += 1
        self._open.add(conn)
        return conn

    def release(self, conn: UpstreamConnection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.max_idle_per_worker:
            conn.close()
        else:
            idle.append(conn)

    def discard(self, conn: UpstreamConnection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def idle_count(self, key: str) -> int:
        return len(self._idle.get(key, ()))

    def close_worker(self, key: str) -> None:
        for conn in [c for c in self._open if c.key == key]:
            conn.close()

    def close_all(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()


async def simple_request(
    host: str, port: int, method: str, path: str, timeout_s: float, body: bytes = b""
) -> tuple[int, bytes]:
    """One request on a fresh connection (health probes, model discovery): (status, body)."""
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            head = (
                f"{method} {path} HTTP/1.1\r\nhost: {host}:{port}\r\nconnection: close\r\n"
                f"content-length: {len(body)}\r\n\r\n"
            )
            writer.write(head.encode() + body)
            raw = await reader.read()
        finally:
            writer.close()
    done: list[bytes] = []
    parts: list[bytes] = []

    class _Collect:
        def on_body(self, data: bytes) -> None:
            parts.append(data)

        def on_message_complete(self) -> None:
            done.append(b"")

    parser = httptools.HttpResponseParser(_Collect())
    parser.feed_data(raw)
    return parser.get_status_code(), b"".join(parts)
