"""``POST /v1/blocks/pull``: ask this sidecar to pull blocks from a peer (e.g. the gateway,
handing a request's prefix from a prefill worker to a decode worker).

Body: ``{"peer_url": "http://...", "keys": [[namespace_seed, block_hash], ...],
"transport": "shm" | "nixl" | "tcp", "timeout_s": 5.0}`` (``transport`` defaults to shm,
``timeout_s`` to the service's ``pull_timeout_s``). Reply: the ``PullResult`` as JSON, or
the pull's error in the OpenAI shape with its status (404 ``unknown_blocks`` with the
missing keys, 503 ``peer_unavailable``, 504 ``transfer_timeout``, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from sidecar.transfer.errors import BadTransferRequestError, TransferError, error_body
from sidecar.transfer.messages import Transport

if TYPE_CHECKING:
    from sidecar.transfer.service import BlockTransferService

__all__ = ["PullRequest", "pull_route"]


class PullRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    peer_url: str
    keys: list[tuple[int, int]]
    transport: Transport = Transport.SHM
    timeout_s: float | None = None


def pull_route(service: BlockTransferService) -> web.RouteDef:
    """The route, bound to ``service``."""

    async def pull(request: web.Request) -> web.Response:
        try:
            try:
                req = msgspec.json.decode(await request.read(), type=PullRequest)
            except msgspec.DecodeError as exc:
                raise BadTransferRequestError(f"bad pull request: {exc}") from exc
            result = await service.pull(req.peer_url, req.keys, transport=req.transport,
                                        timeout_s=req.timeout_s)
        except TransferError as exc:
            return web.json_response(error_body(exc), status=exc.status)
        return web.json_response({
            "transport": result.transport.value,
            "imported": result.imported,
            "already_held": result.already_held,
            "num_bytes": result.num_bytes,
            "seconds": result.seconds,
        })

    return web.post("/v1/blocks/pull", pull)
