"""Sockets in tests: whether a process that went away has let its ports go."""

from __future__ import annotations

import socket

__all__ = ["ports_free"]


def ports_free(*endpoints: str) -> bool:
    """Whether these ``tcp://host:port`` endpoints can be bound again (a ``*`` port is free)."""
    for endpoint in endpoints:
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        if port == "*":
            continue
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, int(port)))
            except OSError:
                return False
    return True
