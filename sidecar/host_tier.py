"""The replica's host tier: the shared-memory block store this sidecar owns, and the block
transfer service that exports its blocks to peer sidecars and pulls theirs.

The store's puts and evictions become host-tier events on every worker's stream (the tier is
shared by every DP rank of the replica); each pull is counted in the sidecar's metrics. With
``--disk-tier-dir`` the store keeps what it evicts on disk (``shm.disk_tier``): those blocks
are ``disk``-tier events, re-announced when the sidecar starts again. With
``--remote-tier-url`` its blocks are shared with the model's other replicas through a
Redis-protocol store (``shm.remote_tier``), scoped by the model id: ``remote``-tier events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import structlog

from adapters.base import EngineAdapter
from kvcore.events import KVEvent
from kvcore.layout import BlockLayout
from shm.config import OwnerConfig
from shm.server import BlockStoreOwner
from sidecar.config import SidecarConfig
from sidecar.transfer import BlockTransferService, PullRecord, TransferConfig

__all__ = ["HostTier"]

log = structlog.get_logger(component="sidecar")


@dataclass(slots=True)
class HostTier:
    """The store and its transfer service, started together, closed in reverse."""

    store: BlockStoreOwner
    transfer: BlockTransferService

    @classmethod
    async def start(
        cls,
        cfg: SidecarConfig,
        adapter: EngineAdapter,
        session: aiohttp.ClientSession,
        *,
        model_id: str,
        on_event: Callable[[KVEvent], None],
        on_pull: Callable[[PullRecord], None],
    ) -> HostTier:
        owner_id = owner_id_of(cfg.worker_id)
        layout: BlockLayout | None = None
        if cfg.store_block_bytes is None:
            layout = adapter.block_layout()
        block_bytes = cfg.store_block_bytes or layout.bytes_per_block  # type: ignore[union-attr]
        socket_path = Path(cfg.store_socket or f"/tmp/kvsidecar-{owner_id}.sock")
        owner_cfg = OwnerConfig(
            owner_id=owner_id,
            socket_path=socket_path,
            capacity_bytes=cfg.store_capacity_bytes,
            block_bytes=block_bytes,
            dtype=layout.dtype if layout is not None else "uint8",
            layout=layout.kind.value if layout is not None else "raw",
            worker_id=cfg.worker_id,
            disk_dir=None if cfg.disk_tier_dir is None else Path(cfg.disk_tier_dir),
            disk_capacity_bytes=cfg.disk_tier_capacity_bytes,
            remote_url=cfg.remote_tier_url,
            remote_scope=model_id,
            remote_write=cfg.remote_tier_write,
        )
        store = BlockStoreOwner(owner_cfg, listener=on_event)
        await store.start()
        transfer = BlockTransferService(
            store,
            session,
            TransferConfig(
                tcp_host=cfg.host,
                tcp_port=cfg.transfer_tcp_port,
                advertise_host=cfg.advertise_host,
            ),
            on_pull=on_pull,
        )
        try:
            await transfer.start()
        except BaseException:
            await store.aclose()
            raise
        log.info(
            "block_store_started",
            socket=str(socket_path),
            block_bytes=block_bytes,
            capacity_bytes=cfg.store_capacity_bytes,
            disk_tier=cfg.disk_tier_dir,
            remote_tier=cfg.remote_tier_url is not None,
        )
        return cls(store, transfer)

    async def aclose(self) -> None:
        # The transfer's leases and NIXL registration go before the segment.
        try:
            await self.transfer.aclose()
        finally:
            await self.store.aclose()


def owner_id_of(worker_id: str) -> str:
    """A shared-memory owner id (letters, digits, '_', '.', '-') from a worker id."""
    cleaned = "".join(c if c.isalnum() or c in "_.-" else "-" for c in worker_id)
    return cleaned[:64] or "sidecar"
