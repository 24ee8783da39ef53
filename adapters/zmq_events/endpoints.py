"""Where each DP rank of a ZMQ KV-event publisher listens, from the address of rank 0.

vLLM's and TensorRT-LLM 1.4's publishers (``ZmqEventPublisher.offset_endpoint_port``) bind
rank ``r`` at the configured TCP port plus ``r``; an ``ipc://`` or ``inproc://`` address gets
the suffix ``_dp<r>`` instead. So one base address and a rank count name every rank's PUB and
replay sockets, as a subscriber dials them (and as the sidecar's own republisher binds its
workers' sockets, ``sidecar/zmq_publisher.py``, where a wildcard port ``*`` stays one).
"""

from __future__ import annotations

from adapters.base import EventEndpoint

__all__ = ["ZMQ_SCHEMES", "is_zmq_address", "rank_address", "rank_endpoints"]

ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
_MAX_PORT = 65535


def is_zmq_address(address: str) -> bool:
    """Whether ``address`` is a ZMQ endpoint (not, say, an engine's HTTP URL)."""
    return address.startswith(ZMQ_SCHEMES)


def rank_address(address: str, rank: int) -> str:
    """Rank ``rank``'s address when rank 0's is ``address`` (``ValueError`` if it cannot be)."""
    if rank == 0:
        return address
    if address.startswith(("ipc://", "inproc://")):
        return f"{address}_dp{rank}"
    if not address.startswith("tcp://"):
        raise ValueError(f"not a ZMQ address (tcp://, ipc:// or inproc://): {address!r}")
    base, colon, port = address.rpartition(":")
    if port == "*" and base != "tcp":
        return address  # a wildcard bind: every rank picks its own free port
    if not colon or not port.isdigit() or base == "tcp":
        raise ValueError(f"a tcp:// KV event address needs a numeric port: {address!r}")
    if int(port) + rank > _MAX_PORT:
        raise ValueError(f"{address!r} plus rank {rank} is past port {_MAX_PORT}")
    return f"{base}:{int(port) + rank}"


def rank_endpoints(
    endpoint: str, replay_endpoint: str | None, ranks: int, topic: str = ""
) -> tuple[EventEndpoint, ...]:
    """One ``EventEndpoint`` per rank, ``0 .. ranks - 1``, from rank 0's addresses."""
    if ranks < 1:
        raise ValueError(f"a publisher has at least one rank, got {ranks}")
    return tuple(
        EventEndpoint(
            r,
            rank_address(endpoint, r),
            None if replay_endpoint is None else rank_address(replay_endpoint, r),
            topic,
        )
        for r in range(ranks)
    )
