"""The importer's HTTP calls to an exporting peer sidecar, with errors mapped to our types.

Connection failures become ``PeerUnavailableError``; an error reply becomes the error
class its code names (``errors.error_from_body``). Every call carries a deadline.
"""

from __future__ import annotations

from typing import TypeVar

import aiohttp
import msgspec
import orjson

from sidecar.transfer.errors import PeerUnavailableError, TransferError, error_from_body
from sidecar.transfer.messages import (
    ExportOffer,
    ExportRequest,
    NamedKeys,
    NamedKeysRequest,
    NixlPeerInfo,
    PeerInfo,
    ReleaseReply,
    encode,
)

__all__ = ["PeerClient"]

T = TypeVar("T")
_JSON = {"Content-Type": "application/json"}


class PeerClient:
    """Calls to ``/v1/blocks/*`` of peer sidecars over one shared ``ClientSession``."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    async def _call(self, method: str, url: str, body: bytes | None, kind: type[T],
                    timeout_s: float) -> T:
        try:
            async with self._session.request(
                method, url, data=body, headers=_JSON if body is not None else None,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except aiohttp.ClientConnectionError as exc:
            raise PeerUnavailableError(f"cannot reach peer at {url}: {exc}") from exc
        if status != 200:
            try:
                body_json = orjson.loads(raw)
            except orjson.JSONDecodeError:
                body_json = None
            raise error_from_body(status, body_json)
        try:
            return msgspec.json.decode(raw, type=kind)
        except msgspec.DecodeError as exc:
            raise TransferError(f"peer at {url} sent a bad {kind.__name__}: {exc}") from exc

    async def export(self, peer_url: str, request: ExportRequest, timeout_s: float) -> ExportOffer:
        return await self._call("POST", f"{peer_url}/v1/blocks/export", encode(request),
                                ExportOffer, timeout_s)

    async def release(self, peer_url: str, export_id: str, timeout_s: float) -> ReleaseReply:
        return await self._call("POST", f"{peer_url}/v1/blocks/exports/{export_id}/release",
                                b"{}", ReleaseReply, timeout_s)

    async def nixl_info(self, peer_url: str, timeout_s: float) -> NixlPeerInfo:
        return await self._call("GET", f"{peer_url}/v1/blocks/nixl", None, NixlPeerInfo,
                                timeout_s)

    async def info(self, peer_url: str, timeout_s: float) -> PeerInfo:
        return await self._call("GET", f"{peer_url}/v1/blocks/info", None, PeerInfo, timeout_s)

    async def named_keys(self, peer_url: str, block_hashes: list[int],
                         timeout_s: float) -> NamedKeys:
        return await self._call("POST", f"{peer_url}/v1/blocks/named",
                                encode(NamedKeysRequest(block_hashes)), NamedKeys, timeout_s)
