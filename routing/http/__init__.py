"""A lean HTTP/1.1 layer for the gateway's hot path: asyncio Protocols + the httptools parser.

``server.py`` accepts clients, ``client.py`` keeps keep-alive connections to workers. Both
are callback-driven (no task per request) and set ``TCP_NODELAY`` on every socket.
"""

from routing.http.client import UpstreamConnection, UpstreamPool, simple_request
from routing.http.server import HttpRequest, RequestHandler, ServerConnection, reason

__all__ = [
    "HttpRequest",
    "RequestHandler",
    "ServerConnection",
    "UpstreamConnection",
    "UpstreamPool",
    "reason",
    "simple_request",
]
