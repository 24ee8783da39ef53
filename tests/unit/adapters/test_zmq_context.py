"""close_context: a ZMQ context's term never holds the event loop past its wait.

The blocked term is made deterministic with a socket the context does not track (built with
``zmq.Socket(ctx, ...)``, not ``ctx.socket``): ``zmq_ctx_term`` cannot finish while it is
open, as it could not while libzmq's I/O thread sat in a stalled name lookup.
"""

from __future__ import annotations

import zmq
import zmq.asyncio
from structlog.testing import capture_logs

from adapters.zmq_events.context import close_context
from tests.support.polling import eventually


async def test_closes_open_sockets_and_terms_the_context() -> None:
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect("tcp://127.0.0.1:9")  # nothing listens: libzmq keeps reconnecting
    with capture_logs() as logs:
        assert await close_context(ctx, owner="test", wait_s=60.0)
    assert sub.closed and ctx.closed
    assert logs == []


async def test_a_term_that_cannot_finish_is_left_to_a_thread_with_a_warning() -> None:
    ctx = zmq.asyncio.Context()
    untracked = zmq.Socket(ctx, zmq.DEALER)
    with capture_logs() as logs:
        assert not await close_context(ctx, owner="test", wait_s=0.05)
    assert [(e["event"], e["owner"]) for e in logs] == [("zmq_context_term_slow", "test")]
    assert not ctx.closed
    untracked.close(linger=0)  # the stall ends: the term in the background finishes
    await eventually(lambda: ctx.closed, "the context termed in the background", 10.0)


async def test_a_closed_context_is_left_alone() -> None:
    ctx = zmq.asyncio.Context()
    ctx.term()
    assert await close_context(ctx, owner="test")
