"""Legs: the upstream requests of one client request, and what each one sends.

A request served by one worker has one leg; a prefill/decode pair has a leg per worker it
talks to. ``LegTarget`` knows what a leg sends to a worker of each kind: the client's request
as it came (a plain OpenAI engine) or the request tokenized for a sidecar
(``TokenizedRequest``), with the pair's ``Handoff`` or ``Bootstrap`` when it has one.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from kvcore.errors import OpenAIError
from kvcore.requests import Bootstrap, Continuation, Handoff, PrefixSource
from routing.http.client import UpstreamConnection
from routing.pipeline.sidecar_body import tokenized_body
from routing.placement.scorer import Placement
from routing.prompt.openai_api import Endpoint, OpenAIRequest
from routing.workers.registry import Worker, WorkerKind

__all__ = ["Drain", "Leg", "LegOwner", "LegTarget"]

_GENERATE = b"/v1/kvsidecar/generate"
_PD_GENERATE = b"/v1/kvsidecar/pd/generate"


class LegTarget:
    """What the legs of one request send: built once at admission."""

    __slots__ = ("body", "continuation", "extra_headers", "path", "request", "request_id",
                 "stream_token_ids", "token_ids", "token_path")

    def __init__(
        self,
        request: OpenAIRequest,
        path: bytes,
        body: bytes,
        token_ids: list[int] | None,
        request_id: bytes,
        extra_headers: bytes,
        token_path: bool = True,
    ) -> None:
        self.request = request
        # Token ids say all the client asked for (else the engine's OpenAI server gets its body).
        self.token_path = token_path
        self.path = path  # the client's path and body (token ids where the gateway rewrote it)
        self.body = body
        self.token_ids = token_ids
        self.request_id = request_id
        self.extra_headers = extra_headers  # the client's headers forwarded to workers
        self.stream_token_ids = False  # a stream that may migrate: its events' ids, please
        self.continuation: Continuation | None = None  # a migrated stream's resumption

    def continued(self, output_ids: list[int], created: int | None) -> LegTarget:
        """The same request, resumed after ``output_ids`` (request migration)."""
        target = LegTarget(self.request, self.path, self.body, self.token_ids,
                           self.request_id, self.extra_headers, self.token_path)
        target.stream_token_ids = True
        target.continuation = Continuation(list(output_ids), created)
        return target

    def takes_token_path(self, worker: Worker) -> bool:
        """Whether a sidecar ``worker`` gets token ids, or else the client's body for its
        engine's own OpenAI server: without token ids (a batch of prompts, an endpoint the
        gateway does not tokenize), and for chats to an engine with a reasoning parser,
        which splits the thinking into ``reasoning_content`` only there."""
        if not self.token_path or self.token_ids is None:
            return False
        return worker.reasoning_parser is None or self.request.endpoint is not Endpoint.CHAT

    def for_worker(
        self,
        worker: Worker,
        *,
        handoff: Handoff | None = None,
        bootstrap: Bootstrap | None = None,
        stream: bool | None = None,
        prefix_source: PrefixSource | None = None,
    ) -> tuple[bytes, bytes]:
        """(path, body) of a leg to ``worker``; ``OpenAIError`` when it cannot take it;
        ``prefix_source``: where a sidecar pulls a moved prefix from."""
        token_path = worker.kind is WorkerKind.SIDECAR and self.takes_token_path(worker)
        if self.continuation is not None and not token_path:
            raise OpenAIError(502, f"the stream cannot resume on {worker.worker_id}: it does "
                              "not take token ids")
        if worker.kind is WorkerKind.PLAIN:
            return self.path, self.body
        body = tokenized_body(self.request, self.token_ids or [], self.request_id.decode(),
                              worker.dp_rank, handoff=handoff, bootstrap=bootstrap,
                              stream=stream, token_path=token_path,
                              stream_token_ids=self.stream_token_ids,
                              continuation=self.continuation, prefix_source=prefix_source)
        return (_GENERATE if handoff is None else _PD_GENERATE), body


class Leg:
    """One upstream request: its worker, placement, load key and connection."""

    __slots__ = ("conn", "connecting", "counted", "key", "placement", "request", "reused",
                 "worker")

    def __init__(self, worker: Worker, placement: Placement, key: str) -> None:
        self.worker = worker
        self.placement = placement
        self.key = key  # its load accounting key in the placement core
        self.request: tuple[bytes, bytes] = (b"", b"")  # (path, body)
        self.conn: UpstreamConnection | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.reused = False  # sent on a pooled keep-alive connection
        self.counted = False  # its load is counted (dispatched, not yet released)

    def wire(self, request_id: bytes, extra_headers: bytes) -> bytes:
        """The HTTP request as it goes on the connection."""
        path, body = self.request
        worker = self.worker
        return (
            b"POST %s%s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nx-request-id: %s\r\n%s%s\r\n%s"
            % (
                worker.address.base_path.encode(),
                path,
                worker.host_header,
                len(body),
                request_id,
                extra_headers,
                worker.control_header,
                body,
            )
        )

    def abandon(self) -> None:
        """Stop waiting for this leg: its connection closes (the worker aborts it)."""
        if self.connecting is not None:
            self.connecting.cancel()
            self.connecting = None
        if self.conn is not None:
            self.conn.detach()
            self.conn = None


class LegOwner(Protocol):
    """Who a drained leg reports to (the request's exchange)."""

    def side_done(self, leg: Leg, status: int) -> None: ...
    def leg_failed(self, leg: Leg, why: str, stale: bool) -> None: ...


class Drain:
    """Receives a leg whose reply nobody reads (the prefill leg of a bootstrap pair)."""

    __slots__ = ("_status", "exchange", "leg")

    def __init__(self, exchange: LegOwner, leg: Leg) -> None:
        self.exchange = exchange
        self.leg = leg
        self._status = 0

    def upstream_head(self, status: int, content_type: bytes, content_length: int | None) -> None:
        self._status = status

    def upstream_body(self, pieces: list[bytes]) -> None:
        pass

    def upstream_complete(self) -> None:
        self.exchange.side_done(self.leg, self._status)

    def upstream_lost(self, exc: Exception | None, got_head: bool) -> None:
        if got_head:
            self.exchange.side_done(self.leg, 502)
        else:
            self.exchange.leg_failed(self.leg, f"connection lost before the reply: {exc!r}",
                                     self.leg.reused)
