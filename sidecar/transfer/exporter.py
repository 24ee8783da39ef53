"""The exporting side: the HTTP routes peers pull through, the TCP stream, lease expiry.

Routes (the service's ``routes()`` returns them for the sidecar's app):

* ``POST /v1/blocks/export``: ``ExportRequest`` → ``ExportOffer``. Leases the blocks for a
  NIXL or TCP pull (all or none: ``UnknownBlocksError`` names the missing keys).
* ``POST /v1/blocks/exports/{export_id}/release``: → ``ReleaseReply``; 410 if lapsed.
* ``GET /v1/blocks/nixl``: → ``NixlPeerInfo`` (this sidecar's NIXL agent).
* ``POST /v1/blocks/named``: ``NamedKeysRequest`` → ``NamedKeys``: the store keys of a
  prefix named by its canonical hashes, as far as the store holds it (what a peer pulls to
  move a prefix, ``sidecar.kv_move``).
* ``GET /v1/blocks/info``: → ``PeerInfo``: block format, transports, the TCP port, and the
  store socket and segment a same-host peer leases and reads through (shm pulls need no
  HTTP per batch).

Errors are JSON in the OpenAI shape with a specific status (``errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable

import numpy as np
import orjson
import structlog
from aiohttp import web

from shm.errors import ClientDetachedError
from shm.owner.server import BlockStoreOwner
from shm.segment import SegmentHeader
from sidecar.transfer.config import TransferConfig
from sidecar.transfer.errors import (
    BadTransferRequestError,
    BlockFormatMismatchError,
    ExportGoneError,
    PeerUnavailableError,
    TransferError,
    TransportUnavailableError,
    error_body,
)
from sidecar.transfer.exports import ExportTable
from sidecar.transfer.messages import (
    ExportOffer,
    ExportRequest,
    NamedKeys,
    NamedKeysRequest,
    PeerInfo,
    ReleaseReply,
    Transport,
    check_keys,
    decode,
    encode,
)
from sidecar.transfer.nixl_transport import NixlEndpoint, load_nixl
from sidecar.transfer.tcp_transport import TcpBlockServer

__all__ = ["BlockExporter"]

log = structlog.get_logger(component="transfer")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _reply(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json")


def _guarded(handler: Handler) -> Handler:
    """Answer our errors as JSON in the OpenAI error shape."""
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except TransferError as exc:
            return _reply(orjson.dumps(error_body(exc)), exc.status)
        except ClientDetachedError as exc:
            gone = PeerUnavailableError(f"the block store is stopping: {exc}")
            return _reply(orjson.dumps(error_body(gone)), gone.status)
    return wrapped


class BlockExporter:
    """Serves this store's blocks to peers; ``start``/``aclose`` with the service."""

    def __init__(self, owner: BlockStoreOwner, config: TransferConfig,
                 nixl_endpoint: Callable[[], Awaitable[NixlEndpoint]]) -> None:
        self.owner = owner
        self.config = config
        self._nixl_endpoint = nixl_endpoint
        self.table = ExportTable(owner)
        self.tcp: TcpBlockServer | None = None
        self._reaper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        cfg = self.config
        if cfg.enable_tcp:
            self.tcp = TcpBlockServer(self.table, self._rows, buffer_bytes=cfg.socket_buffer_bytes)
            await self.tcp.start(cfg.tcp_host, cfg.tcp_port)
        self._reaper = asyncio.create_task(self._reap(), name="transfer_lease_reaper")

    async def aclose(self) -> None:
        """Stop the TCP stream and the reaper; release every open export's leases."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        if self.tcp is not None:
            await self.tcp.aclose()
            self.tcp = None
        self.table.close_all()

    async def _reap(self) -> None:
        period = min(1.0, self.config.lease_ttl_s / 4)
        while True:
            await asyncio.sleep(period)
            self.table.expire()

    def _header(self) -> SegmentHeader:
        if self.owner.segment is None:
            raise ClientDetachedError("the block store owner is not running")
        return self.owner.segment.header

    def _rows(self) -> np.ndarray:
        header = self._header()
        assert self.owner.segment is not None
        return self.owner.segment.slots[:, : header.block_bytes]

    def transports(self) -> list[Transport]:
        found = [Transport.SHM]
        if self.config.enable_nixl:
            with contextlib.suppress(TransportUnavailableError):
                load_nixl()
                found.append(Transport.NIXL)
        if self.tcp is not None:
            found.append(Transport.TCP)
        return found

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/blocks/export", _guarded(self._export)),
            web.post("/v1/blocks/exports/{export_id}/release", _guarded(self._release)),
            web.get("/v1/blocks/nixl", _guarded(self._nixl_info)),
            web.get("/v1/blocks/info", _guarded(self._info)),
            web.post("/v1/blocks/named", _guarded(self._named)),
        ]

    async def _named(self, request: web.Request) -> web.Response:
        req = decode(await request.read(), NamedKeysRequest)
        limit = self.config.max_blocks_per_pull
        if len(req.block_hashes) > limit:
            raise BadTransferRequestError(
                f"{len(req.block_hashes)} block hashes; at most {limit} per request")
        return _reply(encode(NamedKeys(self.owner.keys_named(req.block_hashes))))

    async def _export(self, request: web.Request) -> web.Response:
        req = decode(await request.read(), ExportRequest)
        header = self._header()
        keys = check_keys(req.keys, self.config.max_blocks_per_pull)
        if (req.block_bytes, req.dtype) != (header.block_bytes, header.dtype):
            raise BlockFormatMismatchError(
                f"importer stores {req.block_bytes}-byte {req.dtype} blocks; this store holds "
                f"{header.block_bytes}-byte {header.dtype} blocks")
        nixl_agent = None
        match req.transport:
            case Transport.SHM:
                raise BadTransferRequestError(
                    "shm pulls lease through the block store's socket, not HTTP: see "
                    "GET /v1/blocks/info")
            case Transport.NIXL:
                nixl_agent = (await self._nixl_endpoint()).name
            case Transport.TCP:
                if self.tcp is None:
                    raise TransportUnavailableError(
                        "the tcp transport is disabled on this sidecar")
        export = self.table.open(keys, req.transport, min(req.ttl_s, self.config.lease_ttl_s))
        tcp = req.transport is Transport.TCP and self.tcp is not None
        offer = ExportOffer(
            export_id=export.export_id,
            owner_id=self.owner.config.owner_id,
            transport=req.transport,
            block_bytes=header.block_bytes,
            slot_bytes=header.slot_bytes,
            dtype=header.dtype,
            slots=export.slots,
            generations=export.generations,
            ttl_s=export.deadline - time.monotonic(),
            tcp_host=self.config.tcp_advertised_host if tcp else None,
            tcp_port=self.tcp.port if tcp and self.tcp is not None else None,
            nixl_agent=nixl_agent,
        )
        return _reply(encode(offer))

    async def _release(self, request: web.Request) -> web.Response:
        export_id = request.match_info["export_id"]
        export = self.table.take(export_id)
        if export is None:
            raise ExportGoneError(f"export {export_id} is unknown or its leases lapsed")
        self.table.close(export)
        return _reply(encode(ReleaseReply(export_id, len(export.keys))))

    async def _nixl_info(self, request: web.Request) -> web.Response:
        return _reply(encode((await self._nixl_endpoint()).info()))

    async def _info(self, request: web.Request) -> web.Response:
        header = self._header()
        assert self.owner.segment is not None
        info = PeerInfo(self.owner.config.owner_id, header.block_bytes, header.dtype,
                        self.transports(), None if self.tcp is None else self.tcp.port,
                        os.path.abspath(self.owner.config.socket_path), self.owner.segment.name)
        return _reply(encode(info))
