"""Engines load through the disk tier: the SGLang HiCache backend, plugged into the reference
engine's host-tier hook, reads pages the store evicted to disk, byte-exact, with no change
on the engine's side."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from adapters.sglang.hicache import KvSidecarHiCacheStorage
from refengine.host_tier import HostKVPool, PageStore, StorageConfig, create_page_store
from refengine.page_hash import page_digests
from refengine.presets import ModelConfig
from refengine.tiering import PageStoreClient
from refengine.torch_compute import TorchKVStore
from shm import BlockStoreClient
from shm.tiers.disk_format import HEADER_BYTES
from tests.support.polling import wait_until
from tests.support.store_owner import OwnerThread, owner_config

PAGE = 4
MODEL = ModelConfig(vocab_size=64, num_hidden_layers=2, num_key_value_heads=2, head_dim=8)


def engine_side(socket: Path, kv: TorchKVStore) -> PageStoreClient:
    """What ``refengine.engine`` builds for ``--hicache-storage-backend dynamic``, with a
    2-page staging pool (so store calls go 2 pages at a time)."""
    config = StorageConfig(model_name="tiny-0", logical_page_size=PAGE, extra_config={
        "backend_name": "kvsidecar", "module_path": "adapters.sglang.hicache",
        "class_name": "KvSidecarHiCacheStorage", "socket": str(socket)})
    store = create_page_store("dynamic", config)
    assert isinstance(store, PageStore) and isinstance(store, KvSidecarHiCacheStorage)
    return PageStoreClient(store, HostKVPool(2, PAGE, kv.page_numel, kv.dtype), kv)


def test_an_engine_loads_pages_evicted_to_disk(sock_dir: Path, tmp_path: Path) -> None:
    a, b = TorchKVStore(MODEL, 16, PAGE), TorchKVStore(MODEL, 16, PAGE)
    a.kv.copy_(torch.randn(a.kv.shape, generator=torch.Generator().manual_seed(11)))
    keys = [d.hex() for d in page_digests(list(range(8 * PAGE)), PAGE)]
    page_bytes = a.page_numel * a.kv.element_size()
    config = replace(owner_config(sock_dir, page_bytes, dtype="float32", num_slots=4),
                     disk_dir=tmp_path / "disk",
                     disk_capacity_bytes=32 * (page_bytes + HEADER_BYTES))
    src = [9, 2, 14, 0, 7, 3, 12, 5]
    with OwnerThread(config), BlockStoreClient(config.socket_path) as probe:
        tier_a, tier_b = engine_side(config.socket_path, a), engine_side(config.socket_path, b)
        try:
            assert tier_a.write(keys, src, prefix_keys=[]) == 8  # 4 slots: the first go to disk
            wait_until(lambda: probe.stats().num_disk_blocks >= 4, "4 pages on disk")
            assert probe.stats().num_disk_reads == 0
            assert tier_b.count(keys, prefix_keys=[]) == 8  # shm and disk together
            dst = [1, 4, 6, 8, 10, 11, 13, 15]
            for i in range(0, 8, 2):  # as an engine loads a prefix, a staging pool at a time
                assert tier_b.load(keys[i : i + 2], dst[i : i + 2], prefix_keys=keys[:i]) == 2
            assert probe.stats().num_disk_reads >= 4
        finally:
            tier_a.store.close()  # type: ignore[attr-defined]
            tier_b.store.close()  # type: ignore[attr-defined]
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(a.kv[s], b.kv[d])
    assert not b.kv[0].any()
