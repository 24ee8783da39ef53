"""Ending a ZMQ context without letting libzmq hold the event loop, or a stop.

libzmq resolves the host of a ``tcp://host:port`` endpoint in its own I/O thread, at each
connect and reconnect (a replay probe connects afresh every time), and ``zmq_ctx_term``
waits for that thread. So a name lookup that stalls holds ``term`` for the resolver's whole
timeout. A container's DNS server can stall while ``compose stop`` changes its network: a
sidecar beside an engine named ``engine-0`` then sat 30 s in ``term`` on its event loop, past
its stop grace, and a clean stop ended in SIGKILL (exit 137).

``close_context`` terms the context in a daemon thread and waits ``wait_s`` at most. A term
still waiting then ends in the background when the lookup returns, or is dropped when the
process exits, which loses nothing: its sockets are closed already (linger 0).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import structlog
import zmq

__all__ = ["close_context"]

log = structlog.get_logger(component="adapters.zmq_events")

_TERM_WAIT_S = 2.0


async def close_context(ctx: zmq.Context[Any], *, owner: str,
                        wait_s: float = _TERM_WAIT_S) -> bool:
    """Close ``ctx``'s sockets that are still open (linger 0) and term it off the event
    loop; whether the term finished within ``wait_s``. ``owner`` names the context's user
    in the warning logged when it did not."""
    if ctx.closed:
        return True
    for sock in list(getattr(ctx, "_sockets", None) or ()):  # what destroy() closes
        if sock is not None and not sock.closed:
            sock.close(linger=0)
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()

    def term() -> None:
        try:
            ctx.term()
        finally:  # (a failed term is printed by the thread's excepthook)
            try:
                loop.call_soon_threadsafe(_resolve, finished)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    threading.Thread(target=term, name=f"zmq-term-{owner}", daemon=True).start()
    try:
        await asyncio.wait_for(asyncio.shield(finished), wait_s)
    except TimeoutError:
        log.warning("zmq_context_term_slow", owner=owner, waited_s=wait_s,
                    reason="libzmq's I/O thread is still busy (most likely resolving a "
                    "host name that does not answer); it ends in the background")
        return False
    return True


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
