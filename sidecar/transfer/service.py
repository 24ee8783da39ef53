"""The sidecar's block transfer service: exports blocks to peers and pulls blocks from them.

    service = BlockTransferService(owner, client_session, TransferConfig())
    async with service:                      # TCP listener, lease reaper
        app.add_routes(service.routes())     # /v1/blocks/...
        result = await service.pull(peer_url, keys, transport=Transport.SHM)

The importing side pulls, when it has room: ``pull`` first reserves slots in our store for
the keys we do not hold (``NoRoomError`` if it cannot), then has the peer lease the blocks,
moves the bytes by the chosen transport straight into the reserved slots, and commits only
if the peer's lease provably held throughout:

* shm (same host): leases through the peer's block store socket, copies from its segment
  mapped read-only, re-checks the slots' generations (``shm_transport``);
* NIXL: ``POST /v1/blocks/export``, a NIXL READ, and the READ ended before the lease's
  deadline (counted from before the request); the release is sent in the background, and
  a lost one lapses with the lease's TTL;
* TCP: ``POST /v1/blocks/export``, then the export's stream completed
  (``tcp_transport``).

Any failure or timeout before the commit frees the reservations: nothing of a failed pull
ever becomes visible, and the store goes on serving everything else.

``POST /v1/blocks/pull`` (a ``PullRequest``) runs ``pull`` for whoever starts a transfer,
e.g. the gateway handing a request's prefix from a prefill worker to a decode worker. It
answers the ``PullResult`` as JSON, or the pull's error in the OpenAI shape with its status
(404 ``unknown_blocks`` with the missing keys, 503 ``peer_unavailable``, 504
``transfer_timeout``, ...).

The exporting side (routes, TCP stream, lease expiry) is ``exporter.BlockExporter``.
Close the service before its ``BlockStoreOwner``: it deregisters NIXL memory and releases
export leases, which need the owner's segment and store.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Self

import aiohttp
import structlog
from aiohttp import web

from shm.errors import BlockStoreError, ClientDetachedError, StoreFullError
from shm.owner.local import LocalSession
from shm.owner.server import BlockStoreOwner
from sidecar.transfer.config import TransferConfig
from sidecar.transfer.errors import (
    BadTransferRequestError,
    BlockFormatMismatchError,
    ExportGoneError,
    NoRoomError,
    PeerUnavailableError,
    TransferError,
    TransferTimeoutError,
    TransportUnavailableError,
    UnknownBlocksError,
    error_body,
)
from sidecar.transfer.exporter import BlockExporter
from sidecar.transfer.messages import (
    BlockKey,
    ExportOffer,
    ExportRequest,
    PullRequest,
    PullResult,
    Transport,
    check_keys,
    decode,
)
from sidecar.transfer.nixl_transport import NixlEndpoint, load_nixl
from sidecar.transfer.peer import PeerClient
from sidecar.transfer.shm_transport import ShmPeers
from sidecar.transfer.stats import PullRecord, TransferStats
from sidecar.transfer.tcp_transport import receive_blocks

__all__ = ["BlockTransferService"]

log = structlog.get_logger(component="transfer")
_RELEASE_TIMEOUT_S = 5.0
_RELEASE_DRAIN_S = 1.0
_LEASE_MARGIN_S = 0.05  # clock-rate slack between hosts, and the reply's own delay


class BlockTransferService:
    """Block export/import for one sidecar's store; an async context manager."""

    def __init__(
        self,
        owner: BlockStoreOwner,
        session: aiohttp.ClientSession,
        config: TransferConfig | None = None,
        *,
        on_pull: Callable[[PullRecord], None] | None = None,
    ) -> None:
        self.owner = owner
        self.config = config or TransferConfig()
        self._peers = PeerClient(session)
        self._on_pull = on_pull
        self._exporter = BlockExporter(owner, self.config, self.nixl_endpoint)
        self._shm = ShmPeers(self._peers)
        self._nixl: NixlEndpoint | None = None
        self._nixl_lock = asyncio.Lock()
        self._releases: set[asyncio.Task[None]] = set()
        self._stats = TransferStats()

    # ---------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def start(self) -> None:
        if self.owner.segment is None:
            raise RuntimeError("start the BlockStoreOwner before its transfer service")
        cfg = self.config
        await self._exporter.start()
        if cfg.enable_nixl and cfg.start_nixl_eagerly:
            try:
                await self.nixl_endpoint()
            except TransportUnavailableError as exc:
                log.warning("nixl_unavailable", reason=str(exc))
        log.info("transfer_service_started", owner_id=self.owner.config.owner_id,
                 tcp_port=None if self._exporter.tcp is None else self._exporter.tcp.port,
                 lease_ttl_s=cfg.lease_ttl_s)

    async def aclose(self) -> None:
        """Stop serving exports, release their leases, deregister NIXL, unmap peers."""
        if self._releases:  # tell peers we are done with their exports, briefly
            _, pending = await asyncio.wait(set(self._releases), timeout=_RELEASE_DRAIN_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self._exporter.aclose()
        if self._nixl is not None:
            await self._nixl.aclose()
            self._nixl = None
        await self._shm.aclose()
        log.info("transfer_service_stopped", owner_id=self.owner.config.owner_id)

    async def nixl_endpoint(self) -> NixlEndpoint:
        """This sidecar's NIXL agent, started on first use."""
        if not self.config.enable_nixl:
            raise TransportUnavailableError("the nixl transport is disabled on this sidecar")
        async with self._nixl_lock:
            if self._nixl is None:
                load_nixl()
                segment = self.owner.segment
                if segment is None:
                    raise ClientDetachedError("the block store owner is not running")
                header = segment.header
                endpoint = NixlEndpoint(
                    self.owner.config.owner_id, base_address=int(segment.slots.ctypes.data),
                    slot_bytes=header.slot_bytes, num_slots=header.num_slots,
                    block_bytes=header.block_bytes)
                await endpoint.start()
                self._nixl = endpoint
            return self._nixl

    def stats(self) -> TransferStats:
        stats = self._stats
        table, tcp = self._exporter.table, self._exporter.tcp
        stats.num_exports_opened = table.num_opened
        stats.num_exports_expired = table.num_expired
        stats.num_exports_open = len(table)
        stats.num_stream_bytes_sent = 0 if tcp is None else tcp.num_bytes_sent
        return stats

    def routes(self, *, with_pull: bool = True) -> list[web.RouteDef]:
        """The routes to mount: what peers pull through (``exporter``) and, unless
        ``with_pull=False``, ``POST /v1/blocks/pull`` to trigger a pull."""
        routes = self._exporter.routes()
        if with_pull:
            routes.append(web.post("/v1/blocks/pull", self._serve_pull))
        return routes

    async def _serve_pull(self, request: web.Request) -> web.Response:
        try:
            req = decode(await request.read(), PullRequest)
            result = await self.pull(req.peer_url, req.keys, transport=req.transport,
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

    # ------------------------------------------------------------ importer side
    async def pull(
        self,
        peer_url: str,
        keys: Sequence[BlockKey],
        *,
        transport: Transport | str = Transport.SHM,
        timeout_s: float | None = None,
        parent_hashes: Sequence[int | None] | None = None,
        token_ids: Sequence[list[int] | None] | None = None,
    ) -> PullResult:
        """Copy ``keys`` from the peer's store into ours; all or nothing.

        Raises a ``TransferError``: ``UnknownBlocksError`` (the peer lacks some),
        ``BlockFormatMismatchError``, ``NoRoomError``, ``PeerUnavailableError``,
        ``TransportUnavailableError``, ``ExportGoneError`` or ``TransferTimeoutError``.
        """
        try:
            kind = Transport(transport)
        except ValueError as exc:
            raise BadTransferRequestError(
                f"unknown transport {transport!r}; use one of "
                f"{', '.join(t.value for t in Transport)}") from exc
        checked = check_keys(keys, self.config.max_blocks_per_pull)
        deadline_s = self.config.pull_timeout_s if timeout_s is None else timeout_s
        started = time.perf_counter()
        record = PullRecord(kind, 0, 0, 0.0, TransferError.code)
        try:
            session = LocalSession(self.owner)
        except ClientDetachedError as exc:
            raise TransferError(f"our block store is not running: {exc}") from exc
        try:
            async with asyncio.timeout(deadline_s):
                result = await self._pull(session, peer_url.rstrip("/"), checked, kind,
                                          started + deadline_s, parent_hashes, token_ids)
            record = PullRecord(kind, len(result.imported), result.num_bytes,
                                result.seconds, None)
            return result
        except TimeoutError as exc:
            record = PullRecord(kind, 0, 0, 0.0, TransferTimeoutError.code)
            raise TransferTimeoutError(
                f"pull of {len(checked)} blocks from {peer_url} over {kind.value} took longer "
                f"than {deadline_s:g}s; nothing was imported") from exc
        except TransferError as exc:
            record = PullRecord(kind, 0, 0, 0.0, exc.code)
            raise
        except BlockStoreError as exc:  # a store refused, e.g. ours is shutting down
            record = PullRecord(kind, 0, 0, 0.0, TransferError.code)
            raise TransferError(f"the pull failed in a block store: {exc!r}") from exc
        finally:
            session.close()  # frees whatever was reserved and not committed
            self._stats.record(record)
            if self._on_pull is not None:
                self._on_pull(record)

    async def pull_named(
        self,
        peer_url: str,
        block_hashes: Sequence[int],
        *,
        transport: Transport | str = Transport.SHM,
        timeout_s: float | None = None,
    ) -> PullResult:
        """Pull the leading blocks of a prefix the peer's store holds, named by their
        canonical hashes (``block_hashes``, in chain order): the peer says under which keys
        (``POST /v1/blocks/named``), then ``pull`` as usual. ``UnknownBlocksError`` when it
        holds none of them; otherwise what ``pull`` raises."""
        deadline_s = self.config.pull_timeout_s if timeout_s is None else timeout_s
        started = time.perf_counter()
        url = peer_url.rstrip("/")
        limit = self.config.max_blocks_per_pull
        try:
            named = await self._peers.named_keys(url, list(block_hashes[:limit]), deadline_s)
        except TimeoutError as exc:
            raise TransferTimeoutError(
                f"peer at {url} did not say which of {len(block_hashes)} blocks it holds "
                f"within {deadline_s:g}s") from exc
        if not named.keys:
            raise UnknownBlocksError(f"peer at {url} holds none of the prefix's "
                                     f"{len(block_hashes)} blocks", [])
        left = max(deadline_s - (time.perf_counter() - started), 0.001)
        return await self.pull(url, named.keys, transport=transport, timeout_s=left)

    async def _pull(
        self, session: LocalSession, peer_url: str, keys: list[BlockKey], kind: Transport,
        deadline: float, parent_hashes: Sequence[int | None] | None,
        token_ids: Sequence[list[int] | None] | None,
    ) -> PullResult:
        started = time.perf_counter()
        try:
            reserved = session.reserve(keys, parent_hashes, token_ids)
        except StoreFullError as exc:
            raise NoRoomError(f"no room for {len(keys)} blocks: {exc}") from exc
        except ValueError as exc:
            raise BadTransferRequestError(str(exc)) from exc
        wanted = [i for i, slot in enumerate(reserved.slots) if slot is not None]
        held = tuple(keys[i] for i, slot in enumerate(reserved.slots) if slot is None)
        if not wanted:
            return PullResult(kind, (), held, 0, time.perf_counter() - started)
        dst_slots: list[int] = [reserved.slots[i] for i in wanted]  # type: ignore[misc]
        dst_gens: list[int] = [reserved.generations[i] for i in wanted]  # type: ignore[misc]
        wanted_keys = [keys[i] for i in wanted]
        if kind is Transport.SHM:
            await self._shm.copy(peer_url, wanted_keys, session.rows, dst_slots,
                                 block_bytes=session.block_bytes, dtype=session.dtype,
                                 timeout_s=_left(deadline))
            session.commit(dst_slots, dst_gens)
            return PullResult(kind, tuple(wanted_keys), held,
                              len(wanted) * session.block_bytes, time.perf_counter() - started)
        endpoint = await self.nixl_endpoint() if kind is Transport.NIXL else None
        request = ExportRequest(wanted_keys, kind, session.block_bytes, session.dtype,
                                ttl_s=max(deadline - time.perf_counter(), 0.001))
        asked = time.perf_counter()
        offer = await self._peers.export(peer_url, request, _left(deadline))
        self._stats.num_offers_received += 1
        # The exporter started the lease after we asked, so it lasts at least until then.
        lease_until = asked + offer.ttl_s - _LEASE_MARGIN_S
        try:
            _check_offer(offer, request)
            await self._move(offer, session, dst_slots, peer_url, endpoint, deadline)
            if time.perf_counter() > lease_until and kind is Transport.NIXL:
                raise ExportGoneError(
                    f"the peer's lease ({offer.ttl_s:.3f}s) ran out before the copy finished; "
                    "the bytes read cannot be trusted")
        except BaseException:
            self._release_later(peer_url, offer.export_id)  # TCP too: the stream may not exist
            raise
        if kind is not Transport.TCP:  # a finished TCP stream has ended its export
            self._release_later(peer_url, offer.export_id)
        session.commit(dst_slots, dst_gens)
        return PullResult(kind, tuple(wanted_keys), held, len(wanted) * session.block_bytes,
                          time.perf_counter() - started)

    async def _move(self, offer: ExportOffer, session: LocalSession, dst_slots: list[int],
                    peer_url: str, endpoint: NixlEndpoint | None, deadline: float) -> None:
        match offer.transport:
            case Transport.SHM:
                raise TransferError("shm blocks are not exported over HTTP")
            case Transport.TCP:
                if offer.tcp_host is None or offer.tcp_port is None:
                    raise TransferError("the tcp offer names no host and port")
                await receive_blocks(
                    offer.tcp_host, offer.tcp_port, offer.export_id,
                    [session.rows[s] for s in dst_slots],
                    buffer_bytes=self.config.socket_buffer_bytes, progress=self._count_stream)
            case Transport.NIXL:
                assert endpoint is not None
                agent = offer.nixl_agent or ""
                if not endpoint.knows(agent):
                    info = await self._peers.nixl_info(peer_url, _left(deadline))
                    if info.agent != agent:
                        raise PeerUnavailableError(
                            f"peer NIXL agent changed from {agent} to {info.agent} mid-pull")
                    await endpoint.add_peer(info)
                await endpoint.read(agent, offer.slots, dst_slots, _left(deadline))

    def _release_later(self, peer_url: str, export_id: str) -> None:
        """Give the export back without making the pull wait (the lease deadline, not the
        reply, proves the bytes were read while leased; the exporter's TTL covers a loss)."""
        task = asyncio.create_task(self._release(peer_url, export_id), name="transfer_release")
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, peer_url: str, export_id: str) -> None:
        try:
            await self._peers.release(peer_url, export_id, _RELEASE_TIMEOUT_S)
        except ExportGoneError:
            pass  # it ended already (its TCP stream finished or broke, or its TTL passed)
        except (TransferError, TimeoutError) as exc:
            self._stats.num_release_failures += 1
            log.info("block_export_release_failed", peer_url=peer_url, export_id=export_id,
                     error=str(exc))

    def _count_stream(self, count: int) -> None:
        self._stats.num_stream_bytes_received += count


def _left(deadline: float) -> float:
    return max(deadline - time.perf_counter(), 0.001)


def _check_offer(offer: ExportOffer, request: ExportRequest) -> None:
    if offer.transport is not request.transport:
        raise TransferError(f"asked for {request.transport.value}, offered "
                            f"{offer.transport.value}")
    if (offer.block_bytes, offer.dtype) != (request.block_bytes, request.dtype):
        raise BlockFormatMismatchError(
            f"peer offers {offer.block_bytes}-byte {offer.dtype} blocks; this store holds "
            f"{request.block_bytes}-byte {request.dtype} blocks")
    if len(offer.slots) != len(request.keys) or len(offer.generations) != len(offer.slots):
        raise TransferError(f"peer offered {len(offer.slots)} slots for "
                            f"{len(request.keys)} keys")
