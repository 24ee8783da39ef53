"""SGLang HiCache storage backend backed by the sidecar's shared-memory block store.

Load it into SGLang (0.5.23) with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvsidecar",
        "module_path": "adapters.sglang.hicache", "class_name": "KvSidecarHiCacheStorage",
        "interface_v1": 1, "socket": "/run/kvsidecar/replica-0.sock"}'

``interface_v1`` makes SGLang call ``batch_get_v1``/``batch_set_v1`` with host indices:
pages then move in one ``numpy.copyto`` each, straight between the host KV pool's buffer and
the store's mapped slots (``begin_put`` / ``read``): one store round trip per batch stored,
and none for pages read back that this engine stored itself (the store's read index), one
otherwise (``adapters.sglang.host_pages``). Without it SGLang uses the generic ``batch_get``/
``batch_set`` with flat page tensors, which work too (one extra copy, SGLang's).

The reference engine loads the same class through its ``dynamic`` backend
(``refengine.host_tier.create_page_store``).

Keys: see ``adapters.sglang.hicache_keys``. Failures: a store that is unreachable, went away,
is full or misbehaves turns every affected call into a miss (``False`` / ``0`` / ``None``),
logged and counted (``counters()``), and the engine keeps serving. Only two things raise:
bad ``extra_config`` when SGLang builds the backend, and a store whose block geometry does
not fit the host pool when SGLang registers it (both are start-up configuration errors).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog
import torch

from adapters.sglang.hicache_config import HiCacheBackendConfig
from adapters.sglang.hicache_keys import HiCacheKeyMap, ShardCoordinates
from adapters.sglang.host_pages import HostPages, host_pages_for
from adapters.storage.link import StoreLink
from shm import BlockStoreClient

try:  # a subclass of SGLang's ABC when SGLang is installed (its factory checks issubclass)
    from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        HiCacheStorage as _Base,
    )
except ImportError:  # the reference engine, or any process without the sglang extra
    _Base = object

__all__ = ["KvSidecarHiCacheStorage"]

log = structlog.get_logger(component="adapters.sglang.hicache")

_Keys = list[tuple[int, int]]


class KvSidecarHiCacheStorage(_Base):  # type: ignore[misc,valid-type,unused-ignore]
    """SGLang ``HiCacheStorage`` over the shared-memory block store (see the module doc)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.config = HiCacheBackendConfig.from_extra_config(
            getattr(storage_config, "extra_config", None))
        model_id = self.config.model_id or getattr(storage_config, "model_name", None)
        if not model_id:
            raise ValueError(
                'kvsidecar HiCache backend: no model id; set "model_id" in the extra config '
                "(SGLang passed no model name)")
        self.keys = HiCacheKeyMap(model_id, ShardCoordinates.from_storage_config(storage_config))
        self.mem_pool_host: Any = None
        self._pages: HostPages | None = None
        self._link = StoreLink(
            self.config.socket, expected_owner_id=self.config.owner_id,
            timeout_s=self.config.timeout_s, retry_interval_s=self.config.retry_interval_s,
            check=self._check_store, hook="sglang_hicache")
        log.info("hicache_backend_created", socket=str(self.config.socket), model_id=model_id,
                 namespace_seed=self.keys.namespace_seed, shard=str(self.keys.shard))
        self._link.connect()  # early and non-fatal: an unreachable store only logs here

    # ------------------------------------------------------------ registration
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take the host KV pool; check it against the store now if the store is up."""
        self.mem_pool_host = mem_pool_host
        self._link.connect(strict=True, fresh=True)
        log.info("hicache_pool_registered", pool=type(mem_pool_host).__name__,
                 layout=getattr(mem_pool_host, "layout", None),
                 page_size=getattr(mem_pool_host, "page_size", None),
                 store_connected=self._link.connected,
                 page_access=None if self._pages is None else self._pages.kind)

    def _check_store(self, client: BlockStoreClient) -> None:
        """On every (re)connection: the store's blocks must fit the registered pool's pages."""
        if self.mem_pool_host is None:
            return
        self._pages = host_pages_for(self.mem_pool_host, client.welcome.layout, client.dtype,
                                     client.block_bytes)

    # ----------------------------------------------------------------- queries
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading ``keys`` the store holds (one round trip)."""
        if not keys:
            return 0
        skeys = self._store_keys("batch_exists", keys)
        if skeys is None:
            return 0

        def count(client: BlockStoreClient) -> int:
            flags = client.contains_many(skeys)
            return next((i for i, held in enumerate(flags) if not held), len(flags))

        return self._link.call("batch_exists", count, 0)

    # ------------------------------------------------ zero copy (interface_v1)
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Copy the pages at ``host_indices`` into the store; per key, whether it is held."""
        if not keys:
            return []
        batch = self._batch("batch_set_v1", keys, host_indices)
        if batch is None:
            return [False] * len(keys)
        skeys, pages, access = batch
        parents = self.keys.parent_hashes(skeys, extra_info)

        def put(client: BlockStoreClient) -> list[bool]:
            with client.begin_put(skeys, parent_hashes=parents) as pending:
                for view, page in zip(pending.views, pages, strict=True):
                    if view is not None:
                        access.save(page, view)
            self._count_put(pending.stored)
            return [True] * len(keys)

        return self._link.call("batch_set_v1", put, [False] * len(keys))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Copy held blocks into the pages at ``host_indices``; per key, whether loaded."""
        if not keys:
            return []
        batch = self._batch("batch_get_v1", keys, host_indices)
        if batch is None:
            return [False] * len(keys)
        skeys, pages, access = batch

        def get(client: BlockStoreClient) -> list[bool]:
            # Pages this engine offloaded itself come back without a store round trip.
            hits = client.read(skeys, lambda i, view: access.load(pages[i], view))
            self._count_get(hits)
            return hits

        return self._link.call("batch_get_v1", get, [False] * len(keys))

    # --------------------------------------------------- generic (flat pages)
    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Held blocks as flat pages (into ``target_locations`` when given), else None."""
        misses: list[torch.Tensor | None] = [None] * len(keys)
        skeys = self._store_keys("batch_get", keys)
        targets = [None] * len(keys) if target_locations is None else list(target_locations)
        if skeys is None or not self._same_length("batch_get", keys, targets):
            return misses

        def get(client: BlockStoreClient) -> list[torch.Tensor | None]:
            out: list[torch.Tensor | None] = [None] * len(skeys)

            def copy(i: int, view: np.ndarray) -> None:
                out[i] = self._block_to_flat(view, targets[i])

            self._count_get(client.read(skeys, copy))
            return out

        return self._link.call("batch_get", get, misses)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None, extra_info: Any = None) -> bool:
        """Store flat pages (``get_data_page(flat=True)`` order); True if all are held."""
        skeys = self._store_keys("batch_set", keys)
        if values is None:
            self._bad_request("batch_set", ValueError("batch_set needs the page values"))
            return False
        values = list(values)
        if skeys is None or not self._same_length("batch_set", keys, values):
            return False
        parents = self.keys.parent_hashes(skeys, extra_info)

        def put(client: BlockStoreClient) -> bool:
            with client.begin_put(skeys, parent_hashes=parents) as pending:
                for view, value in zip(pending.views, values, strict=True):
                    if view is not None:
                        self._flat_to_block(value, view)
            self._count_put(pending.stored)
            return True

        return self._link.call("batch_set", put, False)

    # --------------------------------------------------------------- lifecycle
    def clear(self) -> None:
        """Leaves the store alone: it belongs to the sidecar and evicts by LRU on its own."""
        log.info("hicache_clear_skipped", reason="the block store is owned by the sidecar")

    def close(self) -> None:
        self._link.close()

    def get_stats(self) -> None:
        """SGLang's storage-metrics hook; our numbers are in ``counters()``."""
        return None

    def counters(self) -> dict[str, int]:
        return self._link.counters.snapshot()

    @property
    def store_connected(self) -> bool:
        return self._link.connected

    # ---------------------------------------------------------------- helpers
    def _store_keys(self, op: str, keys: Sequence[str]) -> _Keys | None:
        try:
            return self.keys.store_keys(keys)
        except (TypeError, ValueError) as exc:
            self._bad_request(op, exc)
            return None

    def _batch(self, op: str, keys: list[str],
               host_indices: Any) -> tuple[_Keys, list[int], HostPages] | None:
        if self.mem_pool_host is None:
            self._bad_request(op, RuntimeError("register_mem_pool_host was not called"))
            return None
        skeys = self._store_keys(op, keys)
        if skeys is None:
            return None
        if self._link.client() is None:  # connects (and builds the page access) if it can
            self._link.counters.calls_unavailable += 1
            return None
        access = self._pages
        if access is None:
            return None
        try:
            pages = access.page_numbers(host_indices, len(keys))
        except (TypeError, ValueError) as exc:
            self._bad_request(op, exc)
            return None
        return skeys, pages, access

    def _block_to_flat(self, block: np.ndarray, target: Any) -> torch.Tensor:
        access = self._pages
        if target is None:
            target = (access.new_flat_page() if access is not None
                      else torch.empty(block.size, dtype=torch.uint8))
        if not isinstance(target, torch.Tensor) or not target.is_contiguous():
            raise ValueError("a get target must be a contiguous CPU tensor")
        if access is not None:
            np.copyto(access.flat_as_block(target), block.reshape(access.block_shape))
        else:
            flat = target.view(torch.uint8).numpy().reshape(-1)
            if flat.size != block.size:
                raise ValueError(f"a get target of {flat.size} bytes for {block.size}-byte blocks")
            np.copyto(flat, block)
        return target

    def _flat_to_block(self, value: Any, slot: np.ndarray) -> None:
        access = self._pages
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"a page value must be a torch tensor, got {type(value).__name__}")
        if access is not None:
            np.copyto(slot.reshape(access.block_shape), access.flat_as_block(value))
            return
        flat = value.contiguous().view(torch.uint8).numpy().reshape(-1)
        if flat.size != slot.size:
            raise ValueError(f"a page value of {flat.size} bytes for {slot.size}-byte blocks")
        np.copyto(slot, flat)

    def _same_length(self, op: str, keys: Sequence[str], values: Sequence[Any]) -> bool:
        if len(values) == len(keys):
            return True
        self._bad_request(op, ValueError(f"{len(values)} values for {len(keys)} keys"))
        return False

    def _bad_request(self, op: str, exc: Exception) -> None:
        self._link.counters.bad_requests += 1
        log.error("hicache_request_rejected", op=op, error=f"{type(exc).__name__}: {exc}")

    def _count_put(self, stored: list[bool]) -> None:
        copied = sum(stored)
        self._link.counters.blocks_stored += copied
        self._link.counters.blocks_present += len(stored) - copied

    def _count_get(self, hits: list[bool]) -> None:
        loaded = sum(hits)
        self._link.counters.blocks_loaded += loaded
        self._link.counters.blocks_missed += len(hits) - loaded

