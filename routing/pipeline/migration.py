"""A stream whose worker is lost mid-reply: ``Migration``, the base of ``exchange.Exchange``.

A stream whose worker dies after its first byte (or goes silent past ``--upstream-timeout-s``)
*migrates*, up to ``--migration-limit`` times: placed again, away from the workers that
failed it, with the tokens the client already has (``stream_tokens.StreamTokens``) as a
``Continuation``, and relayed on under the head already written. A reply lost before its
head is a failed leg (``Exchange.leg_failed``: placed again); one that cannot migrate is cut.

Kept apart from the exchange's flow as its own base ``error_relay.ErrorRelay`` is: the
flow's steps this base needs are declared there or here and defined by ``Exchange``.
"""

from __future__ import annotations

import structlog

from kvcore.errors import UPSTREAM_TIMEOUT
from routing.pipeline.error_relay import ErrorRelay

__all__ = ["Migration"]

log = structlog.get_logger("routing.pipeline", component="gateway")


class Migration(ErrorRelay):
    """The relayed leg lost (its connection, or its bytes for too long): migrate, or end."""

    __slots__ = ("target",)  # the exchange's; a migrated stream's goes on from its tokens

    done: bool  # the exchange's (``Exchange.__init__`` sets it)

    def _who(self) -> str:
        """Who did not answer in time (``Exchange``)."""
        raise NotImplementedError

    def upstream_lost(self, exc: Exception | None, got_head: bool) -> None:
        if self.done:
            return
        leg = self.leg
        assert leg is not None
        stale = leg.reused
        leg.conn = None
        if not got_head:
            self.leg_failed(leg, f"connection lost before the reply: {exc!r}", stale)
            return
        if self._migrate(f"connection lost mid-reply: {exc!r}"):
            return
        errors = self.ctx.metrics.worker_errors
        errors[leg.worker.worker_id] = errors.get(leg.worker.worker_id, 0) + 1
        self.ctx.metrics.streams_lost += 1
        self._finish(502)
        self.client.abort()  # the reply is cut: the client must see the connection end

    def _migrate(self, why: str) -> bool:
        """The relayed leg died mid-reply: go on on another worker, from what the client
        has, when the stream may migrate and its limit allows (False: it ends here)."""
        tokens, leg, ctx = self.relay.tokens, self.leg, self.ctx
        if tokens is None or leg is None:
            return False
        if tokens.finished:  # the client has the whole answer but its end
            self.release(leg)
            self.relay.end_stream()
            self._finish(200)
            self.client.finish()
            return True
        resumable = tokens.resumable and (bool(tokens.ids) or not self.relay.started)
        if self.record.migrations >= ctx.migration_limit or not resumable:
            log.warning("stream_lost", request_id=self.record.request_id.decode(),
                        worker_id=leg.worker.worker_id, error=why,
                        migrations=self.record.migrations, resumable=resumable)
            return False
        worker_id = leg.worker.worker_id
        leg.abandon()
        self.release(leg)
        ctx.metrics.worker_errors[worker_id] = ctx.metrics.worker_errors.get(worker_id, 0) + 1
        ctx.workers.probed(leg.worker, False, why)
        self.tried.add(worker_id)
        self.record.migrations += 1
        ctx.metrics.migrations += 1
        tokens.tail = b""  # the dead worker's half event: the client never sees it
        if tokens.ids:
            self.target = self.target.continued(tokens.ids, tokens.created)
            self.relay.resuming = True
        log.warning("request_migrated", request_id=self.record.request_id.decode(),
                    from_worker=worker_id, error=why, tokens_streamed=len(tokens.ids),
                    migration=self.record.migrations)
        self._end_pair()
        self._place()
        return True

    def timed_out(self) -> None:
        """No byte from the worker for ``--upstream-timeout-s``."""
        if self.done:
            return
        self.ctx.metrics.upstream_timeouts += 1
        if self.relay_started and self._migrate("no byte for --upstream-timeout-s"):
            return
        self._abandon()
        if self.relay_started:
            self.ctx.metrics.streams_lost += 1
            self._finish(504)
            self.client.abort()
        else:
            self._reply_error(504, f"{self._who()} did not answer in time", UPSTREAM_TIMEOUT)
