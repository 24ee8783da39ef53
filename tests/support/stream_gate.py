"""A gate on one streamed reply: a TCP proxy that holds an SSE stream mid-way, so that a test
acts (kills the engine behind it) while the client provably has part of the stream and not
its end, then cuts the client's connection as the engine's death would. How fast the machine
is does not matter: what the server sent past the gate's point is held, never passed on.

::

    with StreamGate(sidecar_url, b"x-request-id: cut-me", events=4) as gate:
        ...  # the client (a gateway) talks to gate.url in place of sidecar_url
        gate.wait_holding()  # the client has the stream's first 4 events, not its end
        ...  # kill the engine
        gate.cut()  # the client's connection drops; what the gate held goes with it

Every connection is relayed byte for byte both ways on a loop of the gate's own thread
(``LoopThread``: it keeps relaying while the test blocks), but for the reply to the first
request whose bytes hold ``marker`` (a header only that request carries): its head is passed
on, then its chunked body, re-framed, up to the end of its ``events``-th SSE event that has a
``data:`` line (events end in a blank line, ``\\n\\n``, as our sidecars and vLLM write them);
everything after that is held. A reply that is no chunked SSE stream, or that ends before that
event, fails ``wait_holding`` with what it was. HTTP/1.1 without pipelining: the reply on a
connection follows the request on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit

from tests.support.loop_thread import LoopThread

__all__ = ["StreamGate"]

_READ = 65536


class _StreamEnded(Exception):
    """The server closed the gated reply's connection before the gate's point."""


class _Connection:
    """One client connection and its upstream one."""

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream = upstream
        self.gated = False  # its current request is the gated one
        self.holding = False

    def abort(self) -> None:
        self.client.transport.abort()
        self.upstream.transport.abort()


class StreamGate:
    """See the module's docstring. ``url``: where clients connect in ``upstream``'s place."""

    def __init__(self, upstream: str, marker: bytes, events: int,
                 timeout_s: float = 60.0) -> None:
        if events < 1 or not marker:
            raise ValueError(f"a marker and at least 1 event, got {marker!r} and {events}")
        parts = urlsplit(upstream)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self._upstream = (parts.hostname, parts.port)
        self._marker = marker
        self._events = events
        self._timeout_s = timeout_s
        self._thread = LoopThread("stream-gate")
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._armed = True  # the first request carrying the marker has not come yet
        self._gated: _Connection | None = None
        self._cut: asyncio.Event | None = None  # the gate loop's: cut() was called
        self._holding = threading.Event()  # set once holding, or once it cannot be
        self._failure: str | None = None
        self.port = 0
        self.events_passed = 0  # the gated reply's SSE data events the client got

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- the test's side

    def start(self) -> Self:
        self._thread.start()
        self.port = self._thread.run(self._listen())
        return self

    def wait_holding(self) -> None:
        """Until the gated reply is held: its client has exactly ``events`` of its SSE data
        events, and nothing after them. ``AssertionError`` if it cannot be, or no such reply
        came within the gate's ``timeout_s``."""
        if not self._holding.wait(self._timeout_s):
            raise AssertionError(f"no reply held by the gate at {self.url} within "
                                 f"{self._timeout_s:g}s (request marker {self._marker!r})")
        if self._failure is not None:
            raise AssertionError(self._failure)

    def cut(self) -> None:
        """Drop the held reply's connections, the client's and the server's, passing on
        nothing more of it."""
        if not self._holding.is_set() or self._failure is not None:
            raise RuntimeError("cut() is for a reply the gate holds: wait_holding() first")
        self._thread.run(self._cut_now())

    def close(self) -> None:
        """Stop listening and drop every connection (what is held too)."""
        with contextlib.suppress(RuntimeError):  # never started
            self._thread.run(self._close())
        self._thread.close()

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- on the gate's loop

    async def _listen(self) -> int:
        self._cut = asyncio.Event()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _cut_now(self) -> None:
        assert self._cut is not None
        self._cut.set()
        if self._gated is not None:
            self._gated.abort()

    async def _close(self) -> None:
        if self._cut is not None:
            self._cut.set()
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        try:
            upstream_r, upstream_w = await asyncio.open_connection(*self._upstream)
        except OSError:
            client_w.transport.abort()  # as the server's refusal would look
            return
        conn = _Connection(client_w, upstream_w)
        self._connections.add(conn)
        requests = asyncio.create_task(self._requests(client_r, conn))
        try:
            await self._replies(upstream_r, conn)
            if conn.holding:
                assert self._cut is not None
                await self._cut.wait()
        except (OSError, _StreamEnded) as exc:
            self._fail_gated(conn, f"the gated reply's connection failed: {exc!r}")
        finally:
            requests.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await requests
            self._connections.discard(conn)
            if conn.holding or conn.gated:
                conn.abort()  # cut: the client must see its stream end unfinished
            else:
                client_w.close()
                upstream_w.transport.abort()

    async def _requests(self, client_r: asyncio.StreamReader, conn: _Connection) -> None:
        """The client's bytes to the server; the request carrying the marker is gated
        (marked before it is passed on, so before any byte of its reply)."""
        tail = b""
        while data := await client_r.read(_READ):
            if self._armed and self._marker in tail + data:
                self._armed = False
                self._gated = conn
                conn.gated = True
            tail = (tail + data)[-len(self._marker):]
            conn.upstream.write(data)
            await conn.upstream.drain()
        conn.upstream.transport.abort()  # the client is done: so is its server connection

    async def _replies(self, upstream_r: asyncio.StreamReader, conn: _Connection) -> None:
        """The server's bytes to the client, until it closes or the gate holds them."""
        while data := await upstream_r.read(_READ):
            if conn.gated:
                await self._gate(upstream_r, conn, bytearray(data))
                return
            conn.client.write(data)
            await conn.client.drain()

    async def _gate(self, upstream_r: asyncio.StreamReader, conn: _Connection,
                    buf: bytearray) -> None:
        """Pass on the gated reply's head and its chunked body up to the end of its
        ``events``-th SSE data event, then hold (``conn.holding``)."""

        async def more() -> None:
            data = await upstream_r.read(_READ)
            if not data:
                raise _StreamEnded(f"after {self.events_passed} of {self._events} events")
            buf.extend(data)

        while (end := buf.find(b"\r\n\r\n")) < 0:
            await more()
        head = bytes(buf[: end + 4])
        del buf[: end + 4]
        lowered = head.lower()
        if not (head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked" in lowered
                and b"text/event-stream" in lowered):
            self._fail_gated(conn, f"the gated reply is no chunked SSE stream: {head!r}")
            return
        conn.client.write(head)
        scan = b""  # the bytes since the last event's end, passed on already
        while True:
            while (line_end := buf.find(b"\r\n")) < 0:
                await more()
            size = int(bytes(buf[:line_end]).split(b";")[0], 16)
            while len(buf) < line_end + 2 + size + 2:
                await more()
            data = bytes(buf[line_end + 2 : line_end + 2 + size])
            del buf[: line_end + 2 + size + 2]
            if not size:
                self._fail_gated(conn, f"the gated reply ended after {self.events_passed} "
                                 f"SSE data events, before the gate's {self._events}")
                return
            scan += data
            start = 0
            while (boundary := scan.find(b"\n\n", start)) >= 0:
                event, start = scan[start:boundary], boundary + 2
                if any(line.startswith(b"data:") for line in event.split(b"\n")):
                    self.events_passed += 1
                if self.events_passed == self._events:  # pass on up to here, hold the rest
                    passed = data[: len(data) - (len(scan) - start)]
                    if passed:
                        conn.client.write(b"%x\r\n%s\r\n" % (len(passed), passed))
                    await conn.client.drain()
                    conn.holding = True
                    self._holding.set()
                    return
            scan = scan[start:]
            conn.client.write(b"%x\r\n%s\r\n" % (len(data), data))
            await conn.client.drain()

    def _fail_gated(self, conn: _Connection, why: str) -> None:
        if conn.gated and not self._holding.is_set():
            self._failure = why
            self._holding.set()
