"""Same-host transport: lease through the peer's store socket, copy from its mapping.

On one host a pull needs no HTTP per batch. The importer learns the exporter's store
socket once (``GET /v1/blocks/info``), connects as a lease-only reader
(``shm.client.reader.AsyncSegmentReader``: the exporter's segment mapped read-only), and for each
pull leases the keys with one control frame, copies each leased slot straight into its own
reserved slot in a worker thread (one ``memcpy`` per block, no socket copy of payload),
re-checks the slots' generations, and releases. The leases belong to the reader's
connection: if the importer dies, the exporter's owner releases them when the socket
closes. If the exporter dies mid-copy, the mapping stays valid and holds the leased,
committed bytes, so the copy is still right.

A socket or segment that does not exist here means the peer is on another host (or in
another IPC or mount namespace): ``TransportUnavailableError``, use NIXL or TCP.
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import structlog

from shm.client.reader import AsyncSegmentReader
from shm.errors import BlockStoreError, ClientDetachedError
from sidecar.transfer.errors import (
    BlockFormatMismatchError,
    ExportGoneError,
    PeerUnavailableError,
    TransportUnavailableError,
    UnknownBlocksError,
)
from sidecar.transfer.messages import BlockKey
from sidecar.transfer.peer import PeerClient
from sidecar.transfer.threads import run_to_completion

__all__ = ["ShmPeers"]

log = structlog.get_logger(component="transfer")


class ShmPeers:
    """One lease-only reader per peer URL, opened on first use."""

    def __init__(self, peers: PeerClient) -> None:
        self._peers = peers
        self._readers: dict[str, AsyncSegmentReader] = {}
        self._lock = asyncio.Lock()

    async def _reader(self, peer_url: str, timeout_s: float) -> AsyncSegmentReader:
        async with self._lock:
            reader = self._readers.get(peer_url)
            if reader is not None and not reader.closed:
                return reader
            if reader is not None:
                await reader.aclose()
            info = await self._peers.info(peer_url, timeout_s)
            try:
                reader = await AsyncSegmentReader.connect(
                    info.socket, expected_owner_id=info.owner_id, timeout_s=timeout_s)
            except (FileNotFoundError, ConnectionRefusedError, PermissionError) as exc:
                raise TransportUnavailableError(
                    f"cannot reach the store of {peer_url} through {info.socket} "
                    f"({exc.strerror or exc}): the peer is on another host or namespace; use "
                    "the nixl or tcp transport") from exc
            except BlockStoreError as exc:
                raise TransportUnavailableError(f"cannot read the store of {peer_url}: "
                                                f"{exc}") from exc
            self._readers[peer_url] = reader
            log.info("shm_peer_attached", peer_url=peer_url, segment=reader.welcome.segment)
            return reader

    async def copy(self, peer_url: str, keys: list[BlockKey], dst_rows: np.ndarray,
                   dst_slots: list[int], *, block_bytes: int, dtype: str,
                   timeout_s: float) -> None:
        """Copy the peer's blocks ``keys`` into ``dst_rows[dst_slots]`` (same order)."""
        for attempt in (1, 2):  # a peer that restarted behind the same URL: reconnect once
            reader = await self._reader(peer_url, timeout_s)
            if (reader.welcome.block_bytes, reader.welcome.dtype) != (block_bytes, dtype):
                raise BlockFormatMismatchError(
                    f"peer {peer_url} holds {reader.welcome.block_bytes}-byte "
                    f"{reader.welcome.dtype} blocks; this store holds {block_bytes}-byte "
                    f"{dtype} blocks")
            try:
                reply = await reader.lease(keys)
            except ClientDetachedError as exc:
                if attempt == 2:
                    raise PeerUnavailableError(f"lost the store of {peer_url}: {exc}") from exc
                continue
            await self._copy_leased(reader, peer_url, keys, reply.slots, reply.generations,
                                    dst_rows, dst_slots)
            return

    @staticmethod
    async def _copy_leased(reader: AsyncSegmentReader, peer_url: str, keys: list[BlockKey],
                           slots: list[int | None], generations: list[int | None],
                           dst_rows: np.ndarray, dst_slots: list[int]) -> None:
        leased = [s for s in slots if s is not None]
        leased_gens = [g for g in generations if g is not None]
        try:
            missing = [k for k, s in zip(keys, slots, strict=True) if s is None]
            if missing:
                shown = ", ".join(f"({ns}, {h})" for ns, h in missing[:4])
                raise UnknownBlocksError(
                    f"{len(missing)} of {len(keys)} blocks are not held by {peer_url}: {shown}",
                    missing)
            src_rows = reader.rows

            def work() -> list[int]:
                for src, dst in zip(leased, dst_slots, strict=True):
                    dst_rows[dst] = src_rows[src]
                return reader.stale_slots(leased, leased_gens)

            stale = await run_to_completion(work)
            if stale:
                raise ExportGoneError(f"slots {stale[:4]} of {peer_url} were reused while read")
        finally:
            reader.release(leased, leased_gens)

    async def aclose(self) -> None:
        readers, self._readers = list(self._readers.values()), {}
        for reader in readers:
            with contextlib.suppress(OSError):
                await reader.aclose()
