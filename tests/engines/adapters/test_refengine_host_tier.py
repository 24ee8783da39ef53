"""The HiCache backend plugged into the reference engine's host tier (no sglang needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adapters.sglang.hicache import KvSidecarHiCacheStorage
from adapters.storage.link import StoreMismatchError
from refengine.host_tier import HostKVPool, PageStore, StorageConfig, create_page_store
from refengine.page_hash import page_digests
from refengine.presets import ModelConfig
from refengine.tiering import PageStoreClient
from refengine.torch_compute import TorchKVStore
from tests.support.store_owner import OwnerThread, owner_config

PAGE = 4
MODEL = ModelConfig(vocab_size=64, num_hidden_layers=2, num_key_value_heads=2, head_dim=8)


def engine_side(socket: Path, kv: TorchKVStore, host_pages: int = 8) -> PageStoreClient:
    """What ``refengine.engine`` builds for ``--hicache-storage-backend dynamic``."""
    config = StorageConfig(model_name="tiny-0", logical_page_size=PAGE, extra_config={
        "backend_name": "kvsidecar", "module_path": "adapters.sglang.hicache",
        "class_name": "KvSidecarHiCacheStorage", "socket": str(socket)})
    store = create_page_store("dynamic", config)
    assert isinstance(store, PageStore) and isinstance(store, KvSidecarHiCacheStorage)
    return PageStoreClient(store, HostKVPool(host_pages, PAGE, kv.page_numel, kv.dtype), kv)


def test_pages_move_between_two_engines_through_the_store(sock_dir: Path) -> None:
    """Engine A writes its computed pages; engine B loads them into its own pages, exactly."""
    a, b = TorchKVStore(MODEL, 16, PAGE), TorchKVStore(MODEL, 16, PAGE)
    a.kv.copy_(torch.randn(a.kv.shape, generator=torch.Generator().manual_seed(5)))
    keys = [d.hex() for d in page_digests(list(range(6 * PAGE)), PAGE)]
    page_bytes = a.page_numel * a.kv.element_size()
    config = owner_config(sock_dir, page_bytes, dtype="float32", layout="raw")
    with OwnerThread(config):
        tier_a, tier_b = engine_side(config.socket_path, a), engine_side(config.socket_path, b)
        try:
            # Six pages in batches of the 8-page staging pool's size, from scattered pages.
            assert tier_a.write(keys, [9, 2, 14, 0, 7, 3], prefix_keys=[]) == 6
            assert tier_b.count(keys, prefix_keys=[]) == 6
            assert tier_b.load(keys[:4], [1, 5, 10, 11], prefix_keys=[]) == 4
            assert tier_a.write(keys, [9, 2, 14, 0, 7, 3], prefix_keys=[]) == 0  # all held
        finally:
            tier_a.store.clear()
            tier_a.store.close()  # type: ignore[attr-defined]
            tier_b.store.close()  # type: ignore[attr-defined]
    for src, dst in zip([9, 2, 14, 0], [1, 5, 10, 11], strict=True):
        assert torch.equal(a.kv[src], b.kv[dst])
    assert not b.kv[0].any()


def test_a_missing_page_stops_the_load_at_the_prefix(sock_dir: Path) -> None:
    """Loading stops at the first page the store lacks; later pages are not used."""
    a, b = TorchKVStore(MODEL, 8, PAGE), TorchKVStore(MODEL, 8, PAGE)
    a.kv.normal_(generator=torch.Generator().manual_seed(6))
    keys = [d.hex() for d in page_digests(list(range(3 * PAGE)), PAGE)]
    config = owner_config(sock_dir, a.page_numel * 4, dtype="float32", layout="raw")
    with OwnerThread(config):
        tier_a, tier_b = engine_side(config.socket_path, a), engine_side(config.socket_path, b)
        try:
            assert tier_a.write([keys[0], keys[2]], [0, 2], prefix_keys=[]) == 2
            assert tier_b.count(keys, prefix_keys=[]) == 1
            assert tier_b.load(keys, [4, 5, 6], prefix_keys=[]) == 1
        finally:
            tier_a.store.close()  # type: ignore[attr-defined]
            tier_b.store.close()  # type: ignore[attr-defined]
    assert torch.equal(a.kv[0], b.kv[4])
    assert not b.kv[5].any() and not b.kv[6].any()


def test_an_opaque_pool_needs_a_raw_store(sock_dir: Path) -> None:
    """The reference pool's pages have no named order, so a layer-first store is refused."""
    kv = TorchKVStore(MODEL, 4, PAGE)
    config = owner_config(sock_dir, kv.page_numel * 4, dtype="float32", layout="layer_first")
    with OwnerThread(config), pytest.raises(StoreMismatchError, match="--layout raw"):
        engine_side(config.socket_path, kv)


def test_without_a_store_the_engine_still_runs_its_tier(sock_dir: Path) -> None:
    """No owner on the socket: writes store nothing, lookups find nothing, nothing raises."""
    kv = TorchKVStore(MODEL, 4, PAGE)
    tier = engine_side(sock_dir / "absent.sock", kv)
    keys = [d.hex() for d in page_digests(list(range(2 * PAGE)), PAGE)]
    try:
        assert tier.write(keys, [0, 1], prefix_keys=[]) == 0
        assert tier.count(keys, prefix_keys=[]) == 0
        assert tier.load(keys, [2, 3], prefix_keys=[]) == 0
    finally:
        tier.store.close()  # type: ignore[attr-defined]
