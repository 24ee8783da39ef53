"""Page stores behind the HiCache interface: existence prefix, v1 get/set through the host pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from refengine.host_tier import (
    FilePageStore,
    HostKVPool,
    InProcessPageStore,
    PageStore,
    StorageConfig,
    create_page_store,
)

P, NUMEL = 4, 32


def _pool() -> HostKVPool:
    return HostKVPool(8, P, NUMEL, torch.float32)


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> PageStore:
    cfg = StorageConfig(model_name="m", extra_config={"file_path": str(tmp_path)})
    return create_page_store(request.param, cfg)


def test_set_then_get_round_trips(store: PageStore) -> None:
    """Pages written with batch_set_v1 come back byte-equal through batch_get_v1."""
    pool = _pool()
    store.register_mem_pool_host(pool)
    src = pool.alloc(2)
    pool.kv_buffer[pool.page_rows(src)] = torch.randn(2, NUMEL)
    expected = pool.kv_buffer[pool.page_rows(src)].clone()
    assert store.batch_set_v1(["a", "b"], src) == [True, True]
    dst = pool.alloc(3)
    assert store.batch_get_v1(["a", "b", "zz"], dst) == [True, True, False]
    assert torch.equal(pool.kv_buffer[pool.page_rows(dst)[:2]], expected)


def test_batch_exists_counts_the_leading_run(store: PageStore) -> None:
    """batch_exists returns how many keys from the start are present."""
    pool = _pool()
    store.register_mem_pool_host(pool)
    store.batch_set_v1(["a", "b", "d"], pool.alloc(3))
    assert store.batch_exists(["a", "b", "c", "d"]) == 2
    assert store.batch_exists(["x", "a"]) == 0
    store.clear()
    assert store.batch_exists(["a"]) == 0


def test_host_pool_buffer_meta_gives_k_and_v_halves() -> None:
    """get_page_buffer_meta returns two pointers per page, each half the page."""
    pool = _pool()
    idx = pool.alloc(2)
    ptrs, sizes = pool.get_page_buffer_meta(idx)
    assert len(ptrs) == 4 and sizes == [NUMEL * 2] * 4
    assert ptrs[1] - ptrs[0] == NUMEL * 2
    pool.free(idx)
    with pytest.raises(MemoryError):
        pool.alloc(9)


def test_file_store_needs_a_path_and_shares_pages(tmp_path: Path) -> None:
    """The file store requires file_path; a second instance sees the first's pages."""
    with pytest.raises(ValueError, match="file_path"):
        FilePageStore(StorageConfig(extra_config={}), {})
    cfg = StorageConfig(model_name="m", extra_config={"file_path": str(tmp_path)})
    a, b = FilePageStore(cfg, {}), FilePageStore(cfg, {})
    pa, pb = _pool(), _pool()
    a.register_mem_pool_host(pa)
    b.register_mem_pool_host(pb)
    src = pa.alloc(1)
    pa.kv_buffer[pa.page_rows(src)] = 3.0
    a.batch_set_v1(["k"], src)
    dst = pb.alloc(1)
    assert b.batch_get_v1(["k"], dst) == [True]
    assert torch.all(pb.kv_buffer[pb.page_rows(dst)] == 3.0)
    assert not list(tmp_path.glob(".tmp-*"))


def test_dynamic_backend_is_built_like_sglang() -> None:
    """'dynamic' imports module_path.class_name and calls cls(config, {})."""
    extra = {
        "backend_name": "x",
        "module_path": "refengine.host_tier",
        "class_name": "InProcessPageStore",
    }
    store = create_page_store("dynamic", StorageConfig(extra_config=extra))
    assert isinstance(store, InProcessPageStore)
    with pytest.raises(ValueError, match="lacks"):
        create_page_store("dynamic", StorageConfig(extra_config={"backend_name": "x"}))
    with pytest.raises(ValueError, match="cannot be loaded"):
        create_page_store("dynamic", StorageConfig(extra_config={**extra, "class_name": "Nope"}))
    with pytest.raises(ValueError, match="unknown storage backend"):
        create_page_store("mooncake", StorageConfig())


def test_host_pool_hands_out_consecutive_rows_again_after_free() -> None:
    """alloc after free returns ascending rows, so transfers can use a buffer view."""
    pool = _pool()
    first = pool.alloc(3)
    assert pool.pages_view(first) is not None
    pool.free(first)
    again = pool.alloc(3)
    assert torch.equal(pool.page_rows(again), pool.page_rows(first))
    view = pool.pages_view(again)
    assert view is not None and view.data_ptr() == pool.kv_buffer[0].data_ptr()


def test_tier_moves_pages_through_a_small_staging_pool() -> None:
    """More pages than staging holds move byte for byte; pages the store has are skipped."""
    from refengine.presets import ModelConfig
    from refengine.tiering import PageStoreClient
    from refengine.torch_compute import TorchKVStore

    cfg = ModelConfig(
        vocab_size=16,
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        intermediate_size=8,
    )
    src, dst = TorchKVStore(cfg, 12, P), TorchKVStore(cfg, 12, P)
    src.kv.copy_(torch.randn(src.kv.shape))
    store = InProcessPageStore()
    tier = PageStoreClient(store, HostKVPool(3, P, src.page_numel, src.dtype), src)
    keys = [f"k{i}" for i in range(10)]
    assert tier.write(keys, list(range(10)), []) == 10
    assert tier.write(keys, list(range(10)), []) == 0  # already stored
    back = PageStoreClient(store, HostKVPool(3, P, dst.page_numel, dst.dtype), dst)
    assert back.count([*keys, "missing"], []) == 10
    assert back.load(keys, [11, 10, 9, 8, 7, 6, 5, 4, 3, 2], []) == 10
    assert torch.equal(dst.read_pages([11, 10, 2]), src.read_pages([0, 1, 9]))
