"""The relay stage: a worker's reply written to the client as it arrives.

One head (the worker's status and content type, the gateway's headers from the request's
record, the framing), then the body one write per socket read: chunked when the worker did
not say its length. SSE events are counted as they pass (the record's events, the load's
generated tokens); ``usage`` objects are picked out for the metrics (streamed: from the
events that carry one; otherwise from bodies up to 1 MiB). Nothing is rewritten, except in a
stream that may migrate (``tokens``): whole events only, their token-id comments taken out;
its continuation on another worker (``resuming``) goes on under the head already written.
"""

from __future__ import annotations

from routing.http.server import ServerConnection, reason
from routing.metrics import GatewayMetrics
from routing.pipeline.record import RequestRecord
from routing.pipeline.stream_tokens import StreamTokens
from routing.pipeline.usage import count_usage_in_body, count_usage_in_sse

__all__ = ["Relay"]

_USAGE_BODY_LIMIT = 1 << 20  # non-streaming bodies up to this size are scanned for usage
_TRAILER = b"0\r\n\r\n"


class Relay:
    """One reply on its way to the client."""

    __slots__ = (
        "_body_parts",
        "_chunked",
        "_pending_head",
        "_scan_bytes",
        "client",
        "include_usage",
        "metrics",
        "record",
        "resuming",
        "sse",
        "started",
        "tokens",
    )

    def __init__(
        self,
        client: ServerConnection,
        record: RequestRecord,
        metrics: GatewayMetrics,
        include_usage: bool,
    ) -> None:
        self.client = client
        self.record = record
        self.metrics = metrics
        self.include_usage = include_usage
        self.sse = False
        self._chunked = False
        self._pending_head = b""  # written with the first body piece (one write, not two)
        self._body_parts: list[bytes] | None = None
        self._scan_bytes = 0
        self.started = False  # the client has the head
        self.tokens: StreamTokens | None = None  # a stream that may migrate
        self.resuming = False  # a migrated stream's continuation: its head is written

    def head(self, status: int, content_type: bytes, content_length: int | None) -> None:
        if self.resuming:
            return  # the first leg's head stands
        self.sse = content_type.startswith(b"text/event-stream")
        self._chunked = content_length is None
        framing = (
            b"transfer-encoding: chunked\r\n"
            if content_length is None
            else b"content-length: %d\r\n" % content_length
        )
        if self.client.closing:
            framing += b"connection: close\r\n"
        if self.sse:
            framing += b"cache-control: no-cache\r\n"
        elif content_length is None or content_length <= _USAGE_BODY_LIMIT:
            self._body_parts = []  # scanned for usage at the end (chunked: while small)
        self._pending_head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\n%s%s\r\n" % (
            status,
            reason(status),
            content_type or b"application/octet-stream",
            framing,
            self.record.headers(),
        )

    def body(self, pieces: list[bytes]) -> int:
        """Write ``pieces``; returns how many SSE events they held."""
        events = 0
        if self.tokens is not None and self.sse:
            whole = self.tokens.feed(pieces)
            if not whole:
                return 0
            pieces = [whole]
        if self.sse:
            for piece in pieces:
                events += piece.count(b"data:")
                if self.include_usage and b'"usage":{' in piece:
                    cached = count_usage_in_sse(self.metrics, self.record.worker_id, piece)
                    if cached >= 0:
                        self.record.reported_cached = cached
        elif self._body_parts is not None:
            self._body_parts += pieces
            self._scan_bytes += sum(map(len, pieces))
            if self._scan_bytes > _USAGE_BODY_LIMIT:
                self._body_parts = None  # too large to scan
        if self._chunked:
            out = b"".join([b"%x\r\n%s\r\n" % (len(p), p) for p in pieces])
        else:
            out = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        if self._pending_head:
            out = self._pending_head + out
            self._pending_head = b""
            self.started = True
        self.client.write(out)
        return events

    def complete(self) -> None:
        """The worker's reply ended: end the client's (its last chunk, or a bodiless head)."""
        if self._chunked:
            self.client.write(self._pending_head + _TRAILER)
        elif self._pending_head:
            self.client.write(self._pending_head)
        self._pending_head = b""
        self.started = True
        if self._body_parts:
            body = b"".join(self._body_parts)
            self.record.reported_cached = count_usage_in_body(
                self.metrics, self.record.worker_id, body
            )

    def end_stream(self) -> None:
        """End a stream whose worker died after its last event (the finish reason): the
        ``[DONE]`` the worker did not send, and the end of the body."""
        done = b"data: [DONE]\n\n"
        self.client.write(b"%x\r\n%s\r\n%s" % (len(done), done, _TRAILER) if self._chunked
                          else done)
