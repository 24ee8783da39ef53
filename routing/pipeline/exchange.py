"""The place, execute and finish stages of one request: ``Exchange``.

Every request the gateway proxies is an exchange; callback-driven, with no task per request
unless a new upstream connection must be opened::

    place (the policy: ``place.py``) → leg → relay (``relay.py``) → finish (the record)

A request that a prefill/decode pair may serve has a ``Pairing`` (``pairing.py``, done by
``pair.PdPairing``): one object the exchange asks at each step where a pair differs from
one worker (placing, holding and reading an error reply, the relayed body and its end,
abandoning, finishing).
Without one (a gateway with no sidecars) the request goes to one worker. What the exchange
answers when it relays no success (a worker's error, held until whole; a refused route; its
own error) is its base's base's, ``error_relay.ErrorRelay``.

A *leg* is one upstream request on a keep-alive connection (``legs.Leg``); its load is
counted in the placement core from dispatch to release. A leg that fails before the first
byte of its reply (or whose sidecar answers 502 ``engine_unreachable``: its engine is gone)
excludes its worker (marked failed in the registry) and the request is placed again; a
stale keep-alive connection is first retried once on a fresh one. A client that goes away
aborts every leg by closing its connection; an engine stops generating when its client
disconnects.

A stream whose worker dies after its first byte (or goes silent) *migrates*: its base
``migration.Migration``.
"""

from __future__ import annotations

import time

import structlog

from kvcore.errors import (
    RATE_LIMIT_EXCEEDED,
    SERVICE_UNAVAILABLE,
    OpenAIError,
)
from routing.http.client import UpstreamConnection
from routing.http.server import ServerConnection
from routing.pipeline.admission import (
    SHED_BUSY,
    SHED_FAIR_SHARE,
    SHED_HEADER,
    SHED_QUEUE_FULL,
    SHED_QUEUE_TIMEOUT,
    AdmissionQueue,
    Admit,
)
from routing.pipeline.context import PipelineContext
from routing.pipeline.legs import Drain, Leg, LegTarget
from routing.pipeline.migration import Migration
from routing.pipeline.pairing import Pairing
from routing.pipeline.place import HOLDER_BUSY, place_aggregated
from routing.pipeline.record import RequestRecord
from routing.pipeline.relay import Relay
from routing.pipeline.stream_tokens import StreamTokens
from routing.placement.active_load import UnknownRequestError
from routing.placement.refusal import Refusal
from routing.placement.scorer import Placement
from routing.prompt.openai_api import OpenAIRequest
from routing.prompt.preparer import PreparedPrompt
from routing.workers.registry import Role, Worker, WorkerKind

__all__ = ["Exchange"]

log = structlog.get_logger("routing.pipeline", component="gateway")


class Exchange(Migration):
    """A client request on its way through one worker, a pair, or (after retries) several."""

    __slots__ = (
        "client",
        "cost",
        "ctx",
        "done",
        "follow",
        "last_activity",
        "leg",
        "may_hold",
        "pairing",
        "priority",
        "prompt",
        "record",
        "refused",
        "relay",
        "request",
        "session",
        "stale_retry_used",
        "tenant",
        "tried",
        "weight",
    )

    def __init__(
        self,
        ctx: PipelineContext,
        client: ServerConnection,
        record: RequestRecord,
        request: OpenAIRequest,
        prompt: PreparedPrompt,
        target: LegTarget,
        pairing: Pairing[Exchange] | None = None,
    ) -> None:
        self.ctx = ctx
        self.pairing = pairing  # the prefill/decode variant, where the gateway has pairs
        self.client = client
        self.record = record
        self.request = request
        self.prompt = prompt
        self.target = target  # what each leg sends (the client's bytes, or token ids)
        self.relay = Relay(client, record, ctx.metrics, request.include_usage)
        self.leg: Leg | None = None  # the leg whose reply is relayed
        self.tried: set[str] = set()
        self.refused: list[str] = []  # workers whose engines refused its route
        self.stale_retry_used = False
        self.done = False
        self.last_activity = record.t_start
        self._error_parts = None  # an error reply held (``ErrorRelay``)
        # Its place in the admission queue: x-kvsidecar-priority, then its tenant's share.
        self.priority = 0
        self.tenant = ""  # its API key's tenant ("" without --api-key-file)
        self.weight = 1.0  # the tenant's share weight
        # The tokens it asks for; at least 1, so that without a tokenizer requests count.
        self.cost = max(1, prompt.prompt_tokens + (request.max_tokens or 0))
        self.session: bytes | None = None  # x-session-id, with --session-affinity
        self.may_hold = ctx.prompt_hold is not None  # a new prompt waits once for its owner
        self.follow: str | None = None  # released by the owner: the worker it chose
        if (ctx.migration_limit and request.stream and target.token_path
                and target.token_ids is not None):
            self.relay.tokens = StreamTokens()
            target.stream_token_ids = True

    # --- place ---------------------------------------------------------------------------

    def start(self) -> None:
        self.client.in_flight = self
        self.ctx.in_flight[self.record.key] = self
        self._place()

    def _place(self) -> None:
        """Place the request (again): on a pair when its pairing finds one, else on one
        worker."""
        if self.pairing is None or not self.pairing.place(self):
            self.place_unpaired()

    def place_unpaired(self) -> None:
        if self.may_hold:
            self.may_hold = False
            hold = self.ctx.prompt_hold
            assert hold is not None
            ids = self.ctx.workers.routable_ids(Role.AGG)
            if hold.offer(self, self.prompt.block_hashes, self.prompt.prompt_tokens, ids):
                return  # ``hold_released`` places it
        queue = self.ctx.admission
        if queue is not None and len(queue) and not self.tried:
            # Others wait for a worker: a free one goes to the queue's head, which may be
            # this request (a higher priority, a tenant under its share), not to it first.
            self.observe_placement()
            self._wait(queue, None)
            return
        placed = place_aggregated(self.ctx, self.prompt, self.tried, self._serves(),
                                  self.session, itl_target_s=self._itl_target_s(),
                                  follow=self.follow)
        self.observe_placement()
        if isinstance(placed, Refusal) and placed.busy:
            if queue is None:
                self.refuse(placed, b"%s: %s\r\n" % (SHED_HEADER, SHED_BUSY))
            else:
                self._wait(queue, placed)
            return
        self._go(placed)

    def _itl_target_s(self) -> float | None:
        """The request's own ITL target, for the scorer (None: the gateway's)."""
        slo = self.record.slo
        return None if slo is None else slo.itl_s

    def _wait(self, queue: AdmissionQueue, busy: Refusal | None) -> None:
        """Queue it (``admit_waiting`` places it, or ``wait_expired`` answers), or refuse it
        when the queue is full of requests ranking ahead of it."""
        if queue.offer(self):
            queue.wake()
            return
        reason = busy.message if busy is not None else "every worker is busy"
        self._reply_error(429, f"{reason}; {len(queue)} requests are already waiting "
                          f"(--queue-max {queue.max_waiting}), none ranking after this one",
                          RATE_LIMIT_EXCEEDED,
                          b"retry-after: %d\r\n%s: %s\r\n"
                          % (queue.retry_after_s, SHED_HEADER, SHED_QUEUE_FULL))

    def _go(self, placed: tuple[Worker, Placement] | Refusal) -> None:
        if isinstance(placed, Refusal):
            if not self._not_served():
                self.refuse(placed)
            return
        worker, placement = placed
        self.record.placement, self.record.worker_ids = placement, (worker.worker_id,)
        self.run_leg(worker, placement, "a")

    # --- the new-prompt hold's ``HeldPrompt`` ---------------------------------------------

    def hold_released(self, follow: str | None) -> None:
        self.last_activity = time.monotonic()
        self.follow = follow
        self.place_unpaired()

    # --- the admission queue's ``Waiter`` -------------------------------------------------

    def admit_waiting(self, keep_prefix: bool = False) -> Admit:
        """Place it now, unless every worker is still busy (or, with ``keep_prefix``, the
        one holding its prefix is: ``place_aggregated``)."""
        if self.done:
            return Admit.PLACED
        placed = place_aggregated(self.ctx, self.prompt, self.tried, self._serves(),
                                  self.session, keep_prefix, self._itl_target_s(),
                                  self.follow)
        if placed is HOLDER_BUSY:
            return Admit.ELSEWHERE
        if isinstance(placed, Refusal) and placed.busy:
            return Admit.BUSY
        self.last_activity = time.monotonic()
        self._go(placed)
        return Admit.PLACED

    def wait_expired(self, waited_s: float) -> None:
        queue = self.ctx.admission
        assert queue is not None
        self._reply_error(503, f"every worker stayed busy for {waited_s:.1f}s "
                          f"(--queue-timeout-s {queue.timeout_s:g}); retry later",
                          SERVICE_UNAVAILABLE, b"retry-after: %d\r\n%s: %s\r\n"
                          % (queue.retry_after_s, SHED_HEADER, SHED_QUEUE_TIMEOUT))

    def wait_shed(self, tenant_ahead: str) -> None:
        queue = self.ctx.admission
        assert queue is not None
        who = f"tenant {self.tenant!r}" if self.tenant else "this client"
        ahead = f"tenant {tenant_ahead!r}" if tenant_ahead else "another client"
        self._reply_error(429, f"every worker is busy and the queue is full (--queue-max "
                          f"{queue.max_waiting}); {who} is over its fair share, so this "
                          f"request made way for one of {ahead}'s", RATE_LIMIT_EXCEEDED,
                          b"retry-after: %d\r\n%s: %s\r\n"
                          % (queue.retry_after_s, SHED_HEADER, SHED_FAIR_SHARE))

    def observe_placement(self) -> None:
        if not self.tried:
            # parse + tokenize + hash + match + score, first placement only
            self.ctx.metrics.placement.observe(time.monotonic() - self.record.t_start)

    # --- execute -------------------------------------------------------------------------

    def run_leg(self, worker: Worker, placement: Placement, tag: str,
                 request: tuple[bytes, bytes] | None = None) -> None:
        """Send the relayed leg to ``worker`` (``request``: its path and body, if not the
        client's request as that worker takes it)."""
        leg = Leg(worker, placement, f"{self.record.key}/{tag}")
        moves = self.ctx.moves
        try:
            if request is None:
                source = (None if moves is None or worker.kind is not WorkerKind.SIDECAR
                          else moves.source(worker, placement, self.prompt.block_hashes))
                request = self.target.for_worker(worker, prefix_source=source)
            leg.request = request
        except OpenAIError as exc:
            self._reply_error(exc.status, exc.message, exc.code)
            return
        if worker.kind is WorkerKind.SIDECAR and not self.target.takes_token_path(worker):
            self.ctx.metrics.engine_openai_requests += 1
        self.leg = leg
        self.dispatch(leg, self)

    def count(self, leg: Leg) -> None:
        p = self.prompt
        self.ctx.router.dispatch(leg.key, leg.placement, p.block_hashes, p.prompt_tokens)
        leg.counted = True
        leg.worker.dispatched += 1

    def dispatch(self, leg: Leg, receiver: Exchange | Drain) -> None:
        self.count(leg)
        conn = self.ctx.upstream.take_idle(leg.worker.worker_id)
        if conn is not None:
            self._send(leg, receiver, conn, reused=True)
        else:
            leg.connecting = self.ctx.spawn(self._connect(leg, receiver))

    async def _connect(self, leg: Leg, receiver: Exchange | Drain) -> None:
        a = leg.worker.address
        try:
            conn = await self.ctx.upstream.connect(leg.worker.worker_id, a.host, a.port)
        except (OSError, TimeoutError) as exc:
            leg.connecting = None
            if not self.done:
                receiver.upstream_lost(exc, False)
            return
        leg.connecting = None
        if self.done or not leg.counted:
            self.ctx.upstream.release(conn)
            return
        self._send(leg, receiver, conn, reused=False)

    def _send(
        self, leg: Leg, receiver: Exchange | Drain, conn: UpstreamConnection, reused: bool
    ) -> None:
        leg.conn, leg.reused = conn, reused
        self.last_activity = time.monotonic()
        if receiver is self and self.client.write_paused:
            conn.pause_reading()
        conn.send(receiver, leg.wire(self.record.request_id, self.target.extra_headers))

    def release(self, leg: Leg | None) -> None:
        if leg is not None and leg.counted:
            leg.counted = False
            try:
                self.ctx.router.load.finish(leg.key)
            except UnknownRequestError:  # its worker left meanwhile, and its accounting
                pass
            if self.ctx.admission is not None:  # room for a waiting request, maybe
                self.ctx.admission.wake()

    def leg_failed(self, leg: Leg, why: str, stale: bool) -> None:
        """``leg`` failed before the first byte of its reply: try again, elsewhere."""
        ctx = self.ctx
        leg.conn = None
        self.release(leg)
        if stale and not self.stale_retry_used:
            self.stale_retry_used = True
            self.count(leg)
            receiver: Exchange | Drain = self if leg is self.leg else Drain(self, leg)
            leg.connecting = ctx.spawn(self._connect(leg, receiver))
            return
        worker_id = leg.worker.worker_id
        ctx.metrics.worker_errors[worker_id] = ctx.metrics.worker_errors.get(worker_id, 0) + 1
        ctx.workers.probed(leg.worker, False, why)
        if leg is not self.leg:  # a drained leg: the relayed one decides
            self._side_failed(leg, why)
            return
        self.tried.add(worker_id)
        self.record.retries += 1
        ctx.metrics.retries += 1
        self._end_pair()
        self._place()

    # --- relay (``routing.http.client.Receiver`` of the relayed leg) ----------------------

    def upstream_head(self, status: int, content_type: bytes, content_length: int | None) -> None:
        self.record.status = status
        leg, moves = self.leg, self.ctx.moves
        if moves is not None and leg is not None and leg.placement.moved_from is not None:
            moves.reported(leg.placement, None if leg.conn is None else leg.conn.kv_pull)
        if not self._hold_error(status):
            self.relay.head(status, content_type, content_length)

    def upstream_body(self, pieces: list[bytes]) -> None:
        now = self.last_activity = time.monotonic()
        held = self._error_parts
        if held is not None:  # an error reply held whole (``ErrorRelay._hold_error``)
            held += pieces
            return
        record, leg = self.record, self.leg
        assert leg is not None
        first = not record.t_first
        if first:
            record.t_first = now
            self.ctx.metrics.ttft.observe(now - record.t_start)
            self.ctx.router.load.first_token(leg.key)
        record.t_last = now
        events = self.relay.body(pieces)
        if events:
            record.events += events
            self.ctx.router.load.tokens_generated(leg.key, events)
        pairing = self.pairing
        if pairing is not None and pairing.pair is not None:
            pairing.relayed(self, pieces, first)

    def upstream_complete(self) -> None:
        leg = self.leg
        assert leg is not None
        leg.conn = None
        if self._relay_held(leg):
            return
        self.relay.complete()
        record = self.record
        if not record.t_first:  # a reply with no body
            record.t_first = time.monotonic()
            self.ctx.metrics.ttft.observe(record.t_first - record.t_start)
        pairing = self.pairing
        if pairing is not None and pairing.pair is not None:
            pairing.completed(self)
        self._finish(record.status)
        self.client.finish()

    def side_done(self, leg: Leg, status: int) -> None:
        """A drained leg answered (its body is of no use)."""
        leg.conn = None
        self.release(leg)
        if status != 200:
            self._side_failed(leg, f"answered {status}")

    # --- where a pair differs (``Pairing``) --------------------------------------------

    def _side_failed(self, leg: Leg, why: str) -> None:
        if self.pairing is not None:
            self.pairing.side_failed(leg, why)
        else:
            log.warning("drained_leg_failed", worker_id=leg.worker.worker_id, error=why)

    def _who(self) -> str:
        """Who did not answer in time."""
        return "the worker" if self.pairing is None else self.pairing.who()

    def _end_pair(self) -> None:
        if self.pairing is not None:
            self.pairing.end(self)

    def _pair_holds_errors(self) -> bool:
        return self.pairing is not None and self.pairing.holds_errors()

    def _pair_took_error(self, raw: bytes) -> bool:
        return self.pairing is not None and self.pairing.held_error(self, raw)

    # --- client events (``routing.http.server.InFlight``) ---------------------------------

    def on_client_lost(self) -> None:
        if self.done:
            return
        self.ctx.metrics.client_aborts += 1
        self._abandon()
        self._finish(499)

    def on_pause(self) -> None:
        if self.leg is not None and self.leg.conn is not None:
            self.leg.conn.pause_reading()

    def on_resume(self) -> None:
        if self.leg is not None and self.leg.conn is not None:
            self.leg.conn.resume_reading()

    # --- endings -------------------------------------------------------------------------

    def _abandon(self) -> None:
        """Drop every leg on its way (their workers see the connection close)."""
        if self.pairing is not None:
            self.pairing.abandon()
        if self.leg is not None:
            self.leg.abandon()

    def _finish(self, status: int) -> None:
        self._end_pair()
        self.done = True
        self.release(self.leg)
        ctx = self.ctx
        ctx.in_flight.pop(self.record.key, None)
        self.record.finish(status, ctx.metrics, ctx.router.block_size, ctx.log_requests)
