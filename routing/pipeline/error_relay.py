"""What an exchange answers when it does not relay a success: ``ErrorRelay``, the base of
``migration.Migration`` and so of ``exchange.Exchange``.

A worker's error reply is held (``_hold_error``, from ``Exchange.upstream_head``) and, once
complete (``_relay_held``), relayed in the gateway's vocabulary (``kvcore.errors``) and the
route's dialect, with the gateway's headers naming the worker; a sidecar's 502 saying its
engine is gone is a failed leg instead, placed again. One saying the worker's engine lacks
the route (its sidecar's ``endpoint_refused_by_worker``, or a plain engine's bare 404) is not
relayed: the refusal is remembered (``route_refusals.py``) and the request is placed again,
away from the workers that refused it; when every routable worker has refused the route,
the client gets 404 ``endpoint_not_served`` naming them. A pair's exchange decides first what
its held errors mean (``pair.PdPairing.held_error``: a failed KV handoff is re-run).

The exchange's own errors (busy workers, a timeout, a request no worker can take: a
placement's ``Refusal``, answered by ``refuse``) go out through the same door
(``_reply_error``), which ends the exchange first; a migrated stream
that finds no way on is cut instead, as the client already has its head.

Kept apart from the exchange's flow (place, execute, relay) so that each reads on its own;
the flow's steps this base needs are declared here and defined by ``Exchange``.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from kvcore.errors import (
    ENDPOINT_NOT_SERVED,
    ENDPOINT_REFUSED,
    ENGINE_UNREACHABLE,
    OpenAIError,
    error_from_reply,
    route_missing,
)
from routing.http.server import ServerConnection
from routing.pipeline.context import PipelineContext
from routing.pipeline.legs import Leg, LegTarget
from routing.pipeline.record import RequestRecord
from routing.pipeline.relay import Relay
from routing.placement.refusal import Refusal
from routing.prompt.openai_api import OpenAIRequest
from routing.workers.registry import Role, Worker, WorkerKind

__all__ = ["ErrorRelay"]

log = structlog.get_logger("routing.pipeline", component="gateway")
_ENGINE_LOST = b'"code":"%s"' % ENGINE_UNREACHABLE.encode()  # a sidecar's 502: engine gone


class ErrorRelay:
    """The error replies of an exchange: a worker's relayed, a refused route tried
    elsewhere, the exchange's own answered."""

    __slots__ = ("_error_parts",)

    # The exchange's state this base reads (``Exchange.__init__`` sets it).
    ctx: PipelineContext
    client: ServerConnection
    record: RequestRecord
    request: OpenAIRequest
    target: LegTarget
    relay: Relay
    leg: Leg | None
    tried: set[str]
    refused: list[str]  # workers whose engines refused its route
    _error_parts: list[bytes] | None  # an error reply held (this base's own slot)

    # --- the flow's steps (``Exchange``) ----------------------------------------------------

    def _place(self) -> None:
        """Place the request (again)."""
        raise NotImplementedError

    def release(self, leg: Leg | None) -> None:
        """Stop counting ``leg``'s load."""
        raise NotImplementedError

    def _abandon(self) -> None:
        """Drop every leg on its way."""
        raise NotImplementedError

    def _finish(self, status: int) -> None:
        """Done: the load released, the record finished."""
        raise NotImplementedError

    def _end_pair(self) -> None:
        """Release what a pair holds (its load and decode room), if any."""
        raise NotImplementedError

    def leg_failed(self, leg: Leg, why: str, stale: bool) -> None:
        """``leg`` failed before the first byte of its reply: try again, elsewhere."""
        raise NotImplementedError

    def _pair_holds_errors(self) -> bool:
        """Whether a pair holds every reply of its relayed leg that is not a plain 200."""
        raise NotImplementedError

    def _pair_took_error(self, raw: bytes) -> bool:
        """Whether a pair dealt with a held error reply (a failed handoff re-run)."""
        raise NotImplementedError

    # --- a worker's error reply -------------------------------------------------------------

    def _hold_error(self, status: int) -> bool:
        """Whether the relayed leg's reply of ``status`` is held, not relayed as it comes."""
        if status != 200 and (status >= 400 or self.relay.resuming
                              or self._pair_holds_errors()):
            # Held: an error is relayed in the gateway's vocabulary (``relay_error``), or
            # decides a retry (a refused route, a gone engine, a failed handoff).
            self._error_parts = []
            return True
        return False

    def _relay_held(self, leg: Leg) -> bool:
        """A held reply is whole: a retry elsewhere, the pair's to deal with, or relayed
        (False: none was held)."""
        if self._error_parts is None:
            return False
        raw, self._error_parts = b"".join(self._error_parts), None
        if self.record.status == 502 and _ENGINE_LOST in raw:
            # The sidecar is up but its engine is not: as if it failed before its reply.
            self.leg_failed(leg, "its engine is unreachable", False)
        elif not self._pair_took_error(raw):
            self.relay_error(raw)
        return True

    @property
    def relay_started(self) -> bool:
        return bool(self.record.status) and self._error_parts is None

    def relay_error(self, raw: bytes) -> None:
        """A worker's error reply, in the gateway's vocabulary and the route's dialect; a
        route its engine lacks sends the request to the other workers first."""
        status, leg = self.record.status, self.leg
        if status < 400:  # held, but no error (a pair's odd success): as it came
            self._reply_raw(status, raw, answered=True)
            return
        error = error_from_reply(status, raw)
        if leg is not None and (error.code == ENDPOINT_REFUSED or (
                leg.worker.kind is WorkerKind.PLAIN and route_missing(status, raw))):
            self._refused_by(leg)
            return
        self._reply_raw(status, error.body(self.request.endpoint.dialect), answered=True)

    def _refused_by(self, leg: Leg) -> None:
        """``leg``'s engine has no such route: remember it, and place the request again."""
        worker_id = leg.worker.worker_id
        log.info("endpoint_refused", request_id=self.record.request_id.decode(),
                 worker_id=worker_id, path=self.target.path.decode(errors="replace"))
        self.ctx.refusals.add(worker_id, self.target.path)
        self.release(leg)
        self.tried.add(worker_id)
        self.refused.append(worker_id)
        self.record.status = 0
        self._end_pair()
        self._place()

    def _serves(self) -> Callable[[Worker], bool] | None:
        """Only workers not known to refuse the request's route (None: any worker, as
        long as no worker has refused any route)."""
        refusals, path = self.ctx.refusals, self.target.path
        if not refusals:
            return None
        return lambda worker: not refusals.refuses(worker.worker_id, path)

    def _not_served(self) -> bool:
        """No worker left for the request because every routable one refused its route:
        answer 404 ``endpoint_not_served`` naming them (False: not so)."""
        refusals = self.ctx.refusals
        if not self.refused and not refusals:
            return False
        why = refusals.not_served(self.target.path, self.refused,
                                  [w.worker_id for w in self.ctx.workers.routable(Role.AGG)])
        if why is None:
            return False
        self._reply_error(404, why, ENDPOINT_NOT_SERVED)
        return True

    # --- answering ----------------------------------------------------------------------------

    def refuse(self, refusal: Refusal, headers: bytes = b"") -> None:
        """Answer a placement's refusal: its status, message and code, its ``retry-after``
        when it has one, then ``headers``."""
        retry = (b"" if refusal.retry_after_s is None
                 else b"retry-after: %d\r\n" % refusal.retry_after_s)
        self._reply_error(refusal.status, refusal.message, refusal.code, retry + headers)

    def _reply_error(self, status: int, message: str, code: str | None,
                     headers: bytes = b"") -> None:
        body = OpenAIError(status, message, code=code).body(self.request.endpoint.dialect)
        self._reply_raw(status, body, headers)

    def _reply_raw(self, status: int, body: bytes, headers: bytes = b"",
                   answered: bool = False) -> None:
        """Answer ``body``; ``answered``: a worker's answer, with the gateway's headers
        naming it (``RequestRecord.headers``)."""
        self._abandon()
        self._finish(status)
        if self.relay.started:  # a migrated stream that found no way on: cut it
            log.warning("stream_lost", request_id=self.record.request_id.decode(),
                        status=status, error=body[:200].decode(errors="replace"))
            self.ctx.metrics.streams_lost += 1
            self.client.abort()
            return
        ids = (self.record.headers() if answered
               else b"x-request-id: %s\r\n" % self.record.request_id)
        self.client.respond(status, body, extra_headers=ids + headers)
