"""The client-facing HTTP/1.1 server: one ``ServerConnection`` protocol per client socket.

Requests on a connection are answered in order (HTTP/1.1 pipelining is honoured by queueing);
while one is in flight, at most a few more are parsed before reading pauses. The handler
answers either at once (``respond``) or later, by writing through the connection and calling
``finish``. Write backpressure is forwarded to whoever produces the body (``on_pause`` /
``on_resume``), and a client that goes away is reported to the in-flight handler
(``on_client_lost``), which aborts its upstream request.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol

import httptools
import structlog

from kvcore.errors import OpenAIError

__all__ = ["HttpRequest", "RequestHandler", "ServerConnection", "reason"]

log = structlog.get_logger(component="http")

_MAX_QUEUED = 8  # pipelined requests parsed ahead before reading pauses
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


def reason(status: int) -> bytes:
    return _REASONS.get(status, b"Unknown")


@dataclass(slots=True)
class HttpRequest:
    method: bytes
    path: bytes  # without the query string
    headers: dict[bytes, bytes]  # lower-cased names
    body: bytes
    keep_alive: bool


class InFlight(Protocol):
    """What a connection tells the handler of its in-flight request."""

    def on_client_lost(self) -> None: ...
    def on_pause(self) -> None: ...
    def on_resume(self) -> None: ...


class RequestHandler(Protocol):
    def handle(self, conn: ServerConnection, request: HttpRequest) -> None: ...


class BodyTooLargeError(Exception):
    pass


class ServerConnection(asyncio.Protocol):
    """One client connection."""

    __slots__ = (
        "_answering",
        "_body",
        "_body_bytes",
        "_busy",
        "_draining",
        "_handler",
        "_headers",
        "_keep_alive",
        "_max_body_bytes",
        "_on_lost",
        "_parser",
        "_queue",
        "_reading_paused",
        "_url",
        "closed",
        "in_flight",
        "transport",
        "write_paused",
    )

    def __init__(
        self,
        handler: RequestHandler,
        max_body_bytes: int,
        on_lost: Callable[[ServerConnection], None] | None = None,
    ) -> None:
        self._handler = handler
        self._max_body_bytes = max_body_bytes
        self._on_lost = on_lost
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._queue: deque[HttpRequest] = deque()
        self._busy = False
        self._answering = False  # bytes of the current response were written
        self._keep_alive = True
        self._draining = False
        self._reading_paused = False
        self.transport: asyncio.Transport | None = None
        self.in_flight: InFlight | None = None
        self.closed = False
        self.write_paused = False

    # --- asyncio callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass  # not TCP (a Unix socket in tests)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._queue.clear()
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is not None:
            in_flight.on_client_lost()
        if self._on_lost is not None:
            self._on_lost(self)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except BodyTooLargeError:
            self._fail(413, b"request body exceeds %d bytes" % self._max_body_bytes)
        except httptools.HttpParserUpgrade:
            self._fail(400, b"protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._fail(400, b"malformed HTTP request: " + str(exc).encode())

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.in_flight is not None:
            self.in_flight.on_pause()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.in_flight is not None:
            self.in_flight.on_resume()

    # --- httptools callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []
        self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        expect = self._headers.get(b"expect")
        if expect is not None and expect.lower() == b"100-continue" and not self.closed:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._max_body_bytes:
            raise BodyTooLargeError
        self._body.append(body)

    def on_message_complete(self) -> None:
        url = self._url
        q = url.find(b"?")
        body = self._body
        request = HttpRequest(
            self._parser.get_method(),
            url if q < 0 else url[:q],
            self._headers,
            body[0] if len(body) == 1 else b"".join(body),
            self._parser.should_keep_alive(),
        )
        if self._busy:
            self._queue.append(request)
            if len(self._queue) >= _MAX_QUEUED and not self._reading_paused:
                self._reading_paused = True
                self.transport.pause_reading()  # type: ignore[union-attr]
            return
        self._dispatch(request)

    # --- answering -----------------------------------------------------------------------

    def _dispatch(self, request: HttpRequest) -> None:
        self._busy = True
        self._keep_alive = request.keep_alive and not self._draining
        self._answering = False
        try:
            self._handler.handle(self, request)
        except Exception:
            # Raised inside the parser's callback, it would come back as a parser error and
            # the request would vanish unlogged: answer it with a 500 (or cut a started one).
            log.exception("request_handler_failed", method=request.method.decode(),
                          path=request.path.decode(errors="replace"))
            if not self._busy:
                return  # the handler finished the response before it raised
            if self._answering:
                self.abort()
            else:
                self._keep_alive = False
                self.respond(500, OpenAIError(500, "internal error in the gateway while "
                                              "answering this request; see its log "
                                              "(request_handler_failed)").body())

    def write(self, data: bytes) -> None:
        self._answering = True
        if not self.closed:
            self.transport.write(data)  # type: ignore[union-attr]

    def respond(
        self,
        status: int,
        body: bytes,
        content_type: bytes = b"application/json",
        extra_headers: bytes = b"",
    ) -> None:
        """Answer the current request in full and move on to the next one."""
        if not self._keep_alive:
            extra_headers += b"connection: close\r\n"
        self.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n%s"
            % (status, reason(status), content_type, len(body), extra_headers, body)
        )
        self.finish()

    @property
    def closing(self) -> bool:
        """The connection closes after the current response (say so in its head)."""
        return not self._keep_alive

    def drain(self) -> None:
        """The server is stopping: close now if idle, else after the current response (whose
        head, if not yet written, says ``connection: close``)."""
        self._draining = True
        self._keep_alive = False
        if not self._busy and not self.closed and self.transport is not None:
            self.transport.close()

    def finish(self) -> None:
        """The current response is complete: close, or serve the next queued request."""
        self.in_flight = None
        self._busy = False
        if self.closed:
            return
        if not self._keep_alive:
            self.transport.close()  # type: ignore[union-attr]
            return
        if self._queue:
            self._dispatch(self._queue.popleft())
        elif self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]

    def abort(self) -> None:
        """Drop the connection (a response cannot be completed)."""
        if not self.closed:
            self.transport.abort()  # type: ignore[union-attr]

    def _fail(self, status: int, message: bytes) -> None:
        if self._busy or self.closed:
            self.abort()
            return
        body = b'{"error":{"message":"%s","type":"invalid_request_error","param":null,"code":null}}'
        self.transport.write(  # type: ignore[union-attr]
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s"
            % (
                status,
                reason(status),
                len(body % message.replace(b'"', b"'")),
                body % message.replace(b'"', b"'"),
            )
        )
        self.transport.close()  # type: ignore[union-attr]
