"""One proxied request: placement, the upstream exchange, relaying the reply, and retries.

Callback-driven: no task per request unless a new upstream connection must be opened. The
lifecycle, as ``router.load`` sees it::

    place → dispatch → [send → head → body* → complete] → finish
                         └ lost before the first byte → finish, exclude worker, place again

A stale keep-alive connection (closed by the worker while idle) is retried once on a fresh
connection to the same worker before the worker is blamed. A client that goes away aborts
the upstream request by closing its connection; an engine stops generating when its client
disconnects.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcore.errors import OpenAIError
from routing.pipeline.sidecar_body import tokenized_body
from routing.placement.scorer import Placement
from routing.prompt.openai_api import OpenAIRequest
from routing.serve.http_server import ServerConnection, reason
from routing.serve.upstream import UpstreamConnection
from routing.serve.usage import count_usage_in_body, count_usage_in_sse

if TYPE_CHECKING:
    from routing.serve.gateway import Gateway
    from routing.workers.registry import Worker

__all__ = ["Exchange"]

_USAGE_BODY_LIMIT = 1 << 20  # non-streaming bodies up to this size are scanned for usage
_TRAILER = b"0\r\n\r\n"


class Exchange:
    """A client request on its way through one (or, after retries, several) workers."""

    __slots__ = (
        "_body_parts",
        "_chunked",
        "_connecting",
        "_pending_head",
        "_scan_bytes",
        "_sse",
        "block_hashes",
        "body",
        "client",
        "dispatched",
        "done",
        "endpoint",
        "events",
        "extra_headers",
        "gw",
        "include_usage",
        "key",
        "last_activity",
        "path",
        "placement",
        "prompt_tokens",
        "request",
        "request_id",
        "reused",
        "stale_retry_used",
        "status",
        "stream",
        "t_first",
        "t_last",
        "t_start",
        "token_ids",
        "tried",
        "upstream",
        "worker",
    )

    def __init__(
        self,
        gw: Gateway,
        client: ServerConnection,
        key: str,
        request_id: bytes,
        endpoint: str,
        path: bytes,
        body: bytes,
        request: OpenAIRequest,
        token_ids: list[int] | None,
        stream: bool,
        include_usage: bool,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        extra_headers: bytes,
        t_start: float,
    ) -> None:
        self.gw = gw
        self.client = client
        self.key = key
        self.request_id = request_id
        self.endpoint = endpoint
        self.path = path
        self.body = body
        self.request = request
        self.token_ids = token_ids
        self.stream = stream
        self.include_usage = include_usage
        self.block_hashes = block_hashes
        self.prompt_tokens = prompt_tokens
        self.extra_headers = extra_headers
        self.t_start = t_start
        self.tried: set[str] = set()
        self.worker: Worker | None = None
        self.placement: Placement | None = None
        self.upstream: UpstreamConnection | None = None
        self._connecting: asyncio.Task[None] | None = None
        self.dispatched = False
        self.done = False
        self.reused = False
        self.stale_retry_used = False
        self.status = 0
        self.events = 0
        self.t_first = 0.0
        self.t_last = 0.0
        self.last_activity = t_start
        self._pending_head = b""
        self._chunked = False
        self._sse = False
        self._body_parts: list[bytes] | None = None
        self._scan_bytes = 0

    # --- placement -----------------------------------------------------------------------

    def start(self) -> None:
        self.client.in_flight = self
        self._place()

    def _place(self) -> None:
        gw = self.gw
        healthy = gw.workers.healthy()
        if gw.pd is not None:  # never a prefill or decode worker (routing/pd/coordinator.py)
            healthy = gw.pd.agg_only(healthy)
        if not healthy:
            if self.tried:
                self._reply_error(502, "every worker failed before answering", "bad_gateway")
            else:
                self._reply_error(503, "no healthy worker is available", "service_unavailable")
            return
        cap = gw.cfg.max_in_flight_per_worker
        if cap is None:
            names = [w.worker_id for w in healthy]
        else:
            names = [w.worker_id for w in healthy if w.in_flight < cap]
            if not names:
                self._reply_error(
                    429,
                    f"every worker is saturated ({cap} requests in flight each); retry later",
                    "rate_limit_exceeded",
                )
                return
        placement = gw.policy.choose(self.block_hashes, self.prompt_tokens, names, self.tried)
        if not self.tried:  # parse + tokenize + hash + match + score, first placement only
            gw.metrics.placement.observe(time.monotonic() - self.t_start)
        if placement is None:
            self._reply_error(
                502 if self.tried else 503,
                "every worker failed before answering" if self.tried else "no worker available",
                "bad_gateway" if self.tried else "service_unavailable",
            )
            return
        self._dispatch(placement, fresh=False)

    def _dispatch(self, placement: Placement, fresh: bool) -> None:
        gw = self.gw
        worker = gw.workers.get(placement.worker_id)
        self.worker, self.placement = worker, placement
        gw.router.dispatch(self.key, placement, self.block_hashes, self.prompt_tokens)
        self.dispatched = True
        worker.in_flight += 1
        worker.requests += 1
        conn = None if fresh else gw.pool.take_idle(worker.worker_id)
        if conn is not None:
            self._send(conn, True)
        else:
            self._connecting = gw.spawn(self._connect(worker))

    async def _connect(self, worker: Worker) -> None:
        a = worker.address
        try:
            conn = await self.gw.pool.connect(worker.worker_id, a.host, a.port)
        except (OSError, TimeoutError) as exc:
            self._connecting = None
            if not self.done:
                self._failed(f"connect: {type(exc).__name__}: {exc}", stale=False)
            return
        self._connecting = None
        if self.done:
            self.gw.pool.release(conn)
            return
        self._send(conn, False)

    def _wire(self, worker: Worker) -> tuple[bytes, bytes]:
        """(path, body) for this worker: the client's request, or tokenized for a sidecar."""
        if worker.kind != "sidecar":
            return self.path, self.body
        if self.token_ids is None:
            raise OpenAIError(400, "sidecar workers need a single prompt the gateway can tokenize "
                           "(batched prompts are not supported)", param="prompt")
        body = tokenized_body(self.request, self.token_ids, self.request_id.decode(),
                              worker.dp_rank)
        return b"/v1/kvsidecar/generate", body

    def _send(self, conn: UpstreamConnection, reused: bool) -> None:
        worker = self.worker
        assert worker is not None  # set by _dispatch
        try:
            path, body = self._wire(worker)
        except OpenAIError as exc:
            self.gw.pool.release(conn)
            self._reply_error(exc.status, exc.message, exc.type)
            return
        self.upstream, self.reused = conn, reused
        self.last_activity = time.monotonic()
        if self.client.write_paused:
            conn.pause_reading()
        conn.send(
            self,
            b"POST %s%s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nx-request-id: %s\r\n%s\r\n%s"
            % (
                worker.address.base_path.encode(),
                path,
                worker.host_header,
                len(body),
                self.request_id,
                self.extra_headers,
                body,
            ),
        )

    def _failed(self, why: str, stale: bool) -> None:
        """The worker failed before the first byte of its reply: try elsewhere."""
        gw, worker, placement = self.gw, self.worker, self.placement
        assert worker is not None and placement is not None
        self.upstream = None
        self._release()
        if stale and not self.stale_retry_used:
            self.stale_retry_used = True
            self._dispatch(placement, fresh=True)
            return
        gw.metrics.worker_errors[worker.worker_id] = (
            gw.metrics.worker_errors.get(worker.worker_id, 0) + 1
        )
        gw.workers.mark(worker, False, why)
        self.tried.add(worker.worker_id)
        gw.metrics.retries += 1
        self._place()

    # --- upstream events (routing.serve.upstream.Receiver) ----------------------------------

    def upstream_head(self, status: int, content_type: bytes, content_length: int | None) -> None:
        self.status = status
        self._sse = content_type.startswith(b"text/event-stream")
        self._chunked = content_length is None
        placement = self.placement
        assert placement is not None
        framing = (
            b"transfer-encoding: chunked\r\n"
            if content_length is None
            else b"content-length: %d\r\n" % content_length
        )
        if self._sse:
            framing += b"cache-control: no-cache\r\n"
        elif content_length is None or content_length <= _USAGE_BODY_LIMIT:
            self._body_parts = []  # scanned for usage at the end (chunked: while small)
        self._pending_head = (
            b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\n%sx-request-id: %s\r\n"
            b"x-kvsidecar-worker: %s\r\nx-kvsidecar-cached-blocks: %d\r\n\r\n"
            % (
                status,
                reason(status),
                content_type or b"application/octet-stream",
                framing,
                self.request_id,
                placement.worker_id.encode(),
                placement.overlap.longest,
            )
        )

    def upstream_body(self, pieces: list[bytes]) -> None:
        now = time.monotonic()
        self.last_activity = now
        if not self.t_first:
            self.t_first = now
            self.gw.metrics.ttft.observe(now - self.t_start)
            self.gw.router.load.first_token(self.key)
        self.t_last = now
        if self._sse:
            events = 0
            for piece in pieces:
                events += piece.count(b"data:")
                if self.include_usage and b'"usage":{' in piece:
                    count_usage_in_sse(self.gw.metrics, self._worker_id(), piece)
            if events:
                self.events += events
                self.gw.router.load.tokens_generated(self.key, events)
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
        self.client.write(out)

    def upstream_complete(self) -> None:
        self.upstream = None
        if self._chunked:
            self.client.write(self._pending_head + _TRAILER)
        elif self._pending_head:
            self.client.write(self._pending_head)
        self._pending_head = b""
        if self._body_parts:
            count_usage_in_body(self.gw.metrics, self._worker_id(), b"".join(self._body_parts))
        if not self.t_first:
            self.gw.metrics.ttft.observe(time.monotonic() - self.t_start)
        self._finish(self.status)
        self.client.finish()

    def upstream_lost(self, exc: Exception | None, got_head: bool) -> None:
        if self.done:
            return
        self.upstream = None
        if not got_head:
            self._failed(f"connection lost before the reply: {exc!r}", stale=self.reused)
            return
        worker = self.worker
        assert worker is not None
        errors = self.gw.metrics.worker_errors
        errors[worker.worker_id] = errors.get(worker.worker_id, 0) + 1
        self._finish(502)
        self.client.abort()  # the reply is cut: the client must see the connection end

    # --- client events (routing.serve.http_server.InFlight) ------------------------------------

    def on_client_lost(self) -> None:
        if self.done:
            return
        self.gw.metrics.client_aborts += 1
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        if self.upstream is not None:
            self.upstream.detach()
            self.upstream = None
        self._finish(499)

    def on_pause(self) -> None:
        if self.upstream is not None:
            self.upstream.pause_reading()

    def on_resume(self) -> None:
        if self.upstream is not None:
            self.upstream.resume_reading()

    def timed_out(self) -> None:
        """No byte from the worker for ``--upstream-timeout-s``."""
        if self.done:
            return
        self.gw.metrics.upstream_timeouts += 1
        if self.upstream is not None:
            self.upstream.detach()
            self.upstream = None
        if self.status:
            self._finish(504)
            self.client.abort()
        else:
            self._reply_error(504, "the worker did not answer in time", "timeout")

    def _worker_id(self) -> str:
        return "" if self.worker is None else self.worker.worker_id

    # --- endings -------------------------------------------------------------------------

    def _release(self) -> None:
        if self.dispatched:
            self.dispatched = False
            self.gw.router.load.finish(self.key)
            self.worker.in_flight -= 1  # type: ignore[union-attr]

    def _finish(self, status: int) -> None:
        self.done = True
        self._release()
        gw = self.gw
        gw.exchanges.pop(self.key, None)
        m = gw.metrics
        m.count_response(self.endpoint, status)
        now = time.monotonic()
        m.latency.observe(now - self.t_start)
        if self.worker is not None and status < 500:
            wid = self.worker.worker_id
            m.worker_requests[wid] = m.worker_requests.get(wid, 0) + 1
            m.worker_prompt_tokens[wid] = m.worker_prompt_tokens.get(wid, 0) + self.prompt_tokens
            if self.placement is not None and self.placement.overlap.longest:
                predicted = min(
                    self.prompt_tokens, self.placement.overlap.longest * gw.router.block_size
                )
                m.predicted_cached_tokens += predicted
                table = m.worker_predicted_cached_tokens
                table[wid] = table.get(wid, 0) + predicted
        if self.events:
            m.completion_tokens += self.events
            if self.events > 1:
                m.itl.observe((self.t_last - self.t_first) / (self.events - 1))
        if gw.debug:
            gw.log_request(self, status, now)

    def _reply_error(self, status: int, message: str, type_: str) -> None:
        self._finish(status)
        headers = b"x-request-id: %s\r\n" % self.request_id
        body = OpenAIError(status, message, type_).body()
        self.client.respond(status, body, extra_headers=headers)
