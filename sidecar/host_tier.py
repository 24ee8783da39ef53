"""The replica's host tier: the shared-memory block store this sidecar owns, and the block
transfer service that exports its blocks to peer sidecars and pulls theirs.

The store's puts and evictions become host-tier events on every worker's stream (the tier is
shared by every DP rank of the replica); each pull is counted in the sidecar's metrics. With
``--disk-tier-dir`` the store keeps what it evicts on disk (``shm.tiers.disk_tier``): those blocks
are ``disk``-tier events, re-announced when the sidecar starts again. With
``--remote-tier-url`` its blocks are shared with the model's other replicas through a
Redis-protocol store (``shm.tiers.remote_tier``), scoped by the model id: ``remote``-tier events.

Every tier's events name blocks canonically, whatever the engine's storage hook keys them by
(``shm.block_names``): for a hook that keys them by the engine's own block hashes (SGLang's
HiCache) the store learns each block's name from the adapter, which reports every chain the
engine stores (``store_names``, wired before the adapter starts).

The store's block geometry is the engine's: ``--store-block-bytes`` or the model's KV layout
(``adapter.block_layout()``), in ``--store-layout`` order or else the one the engine's hook
writes (the adapter's layout ``kind``; ``raw``, the hook's own order, with
``--store-block-bytes``), so the hook accepts the store without further flags.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import structlog

from adapters.base import EngineAdapter, StoreKeys
from kvcore.events import KVEvent
from kvcore.layout import BlockLayout, LayoutKind
from shm.block_names import BlockNames
from shm.owner.config import OwnerConfig
from shm.owner.server import BlockStoreOwner
from sidecar.config import SidecarConfig
from sidecar.transfer import BlockTransferService, PullRecord, TransferConfig

__all__ = ["HostTier", "store_names"]

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
        names: BlockNames | None,
        on_event: Callable[[KVEvent], None],
        on_pull: Callable[[PullRecord], None],
    ) -> HostTier:
        owner_id = owner_id_of(cfg.worker_id)
        block_bytes, dtype, kind = store_geometry(cfg, adapter)
        socket_path = Path(cfg.store_socket or f"/tmp/kvsidecar-{owner_id}.sock")
        owner_cfg = OwnerConfig(
            owner_id=owner_id,
            socket_path=socket_path,
            capacity_bytes=cfg.store_capacity_bytes,
            block_bytes=block_bytes,
            dtype=dtype,
            layout=kind.value,
            worker_id=cfg.worker_id,
            disk_dir=None if cfg.disk_tier_dir is None else Path(cfg.disk_tier_dir),
            disk_capacity_bytes=cfg.disk_tier_capacity_bytes,
            remote_url=cfg.remote_tier_url,
            remote_scope=model_id,
            remote_write=cfg.remote_tier_write,
        )
        store = BlockStoreOwner(owner_cfg, listener=on_event, names=names)
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
            layout=kind.value,
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


def store_names(cfg: SidecarConfig, adapter: EngineAdapter) -> BlockNames | None:
    """The names of the store's blocks (None: no store), learning them from the adapter
    when the engine's hook keys blocks by the engine's own hashes; call before the adapter
    starts, so the engine's first blocks are named too."""
    if not cfg.store_capacity_bytes:
        return None
    engine_keys = adapter.store_keys is StoreKeys.ENGINE
    names = BlockNames(cfg.worker_id, canonical_keys=not engine_keys)
    if engine_keys:
        adapter.watch_store_names(names.learn)
    return names


def store_geometry(cfg: SidecarConfig, adapter: EngineAdapter) -> tuple[int, str, LayoutKind]:
    """The store's block bytes, dtype and layout (see the module docstring)."""
    if cfg.store_block_bytes is not None:
        return cfg.store_block_bytes, "uint8", cfg.store_layout or LayoutKind.RAW
    layout: BlockLayout = adapter.block_layout()
    return layout.bytes_per_block, layout.dtype, cfg.store_layout or layout.kind


def owner_id_of(worker_id: str) -> str:
    """A shared-memory owner id (letters, digits, '_', '.', '-') from a worker id."""
    cleaned = "".join(c if c.isalnum() or c in "_.-" else "-" for c in worker_id)
    return cleaned[:64] or "sidecar"
