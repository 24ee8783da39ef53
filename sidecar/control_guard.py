"""The control token's check on a sidecar's HTTP routes (``--control-token-file``).

Every route but ``/health`` and ``/metrics`` answers 401 ``invalid_control_token`` to a caller
without the token in ``x-kvsidecar-token`` (``kvcore.control_token``); the sidecar and the
standalone block peer (``kvsidecar blocks``) install it alike.
"""

from __future__ import annotations

import orjson
import structlog
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from kvcore.control_token import CONTROL_TOKEN_HEADER, token_matches
from kvcore.errors import OpenAIError

__all__ = ["OPEN_PATHS", "token_guard"]

log = structlog.get_logger(component="sidecar")
OPEN_PATHS = frozenset(("/health", "/metrics"))  # probes and scrapes send no token

def token_guard(token: str) -> Middleware:
    """An aiohttp middleware refusing (401) every route but ``OPEN_PATHS`` to a caller
    without ``token``, compared in constant time."""
    refusal = orjson.dumps(OpenAIError(
        401,
        f"this sidecar's control endpoints need its token in '{CONTROL_TOKEN_HEADER}' "
        "(the gateway's --sidecar-token-file)",
        code="invalid_control_token",
    ).to_dict())

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS or token_matches(
            request.headers.get(CONTROL_TOKEN_HEADER), token
        ):
            return await handler(request)
        log.warning("control_request_unauthorized", path=request.path, peer=request.remote,
                    has_token=CONTROL_TOKEN_HEADER in request.headers)
        return web.Response(body=refusal, status=401, content_type="application/json")

    return guard
