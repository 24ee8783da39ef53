"""The HiCache backend inside real SGLang: its factory, its host-pool code, a real store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

pytestmark = pytest.mark.sglang

hicache_storage = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
backend_factory = pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")
sglang_utils = pytest.importorskip("sglang.srt.mem_cache.utils")

from adapters.sglang.hicache import KvSidecarHiCacheStorage  # noqa: E402
from adapters.storage.link import StoreMismatchError  # noqa: E402
from shm import BlockStoreClient  # noqa: E402
from tests.engines.adapters.sglang_pools import make_mha_host_pool  # noqa: E402
from tests.support.store_owner import OwnerProcess, OwnerThread, owner_config  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 8, 4
PAGE_BYTES = LAYERS * 2 * HEADS * HEAD_DIM * PAGE * 2  # bfloat16
HOST_LAYOUTS = ["page_first", "layer_first", "page_first_direct", "page_head"]
STORE_LAYOUTS = ["layer_first", "page_first", "raw"]


def storage_config(socket: Path | str, **extra: Any) -> Any:
    """SGLang's own HiCacheStorageConfig, as its cache controller fills it on one rank."""
    return hicache_storage.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="org/model-a",
        extra_config={"backend_name": "kvsidecar", "module_path": "adapters.sglang.hicache",
                      "class_name": "KvSidecarHiCacheStorage", "interface_v1": 1,
                      "socket": str(socket), **extra})


def create(socket: Path | str, pool: Any = None, **extra: Any) -> Any:
    """The backend exactly as SGLang's controller makes it: factory, then registration."""
    backend = backend_factory.StorageBackendFactory.create_backend(
        "dynamic", storage_config(socket, **extra), pool)
    if pool is not None:
        backend.register_mem_pool_host(pool)
    return backend


def page_keys(num_pages: int, start: int = 0) -> list[str]:
    """Real SGLang page keys: the SHA-256 chain of ``get_hash_str``."""
    tokens = list(range(start, start + num_pages * PAGE))
    return sglang_utils.get_hash_str(tokens, None, page_size=PAGE)  # type: ignore[no-any-return]


def page_bytes(pool: Any, page: int) -> torch.Tensor:
    return pool.get_data_page(page * PAGE).view(torch.uint8).clone()


def logical_kv(pool: Any, page: int) -> torch.Tensor:
    """A page as ``[k|v, layer, token, head, dim]`` from the pool's own buffer, by layout."""
    i, kv = page * PAGE, pool.kv_buffer
    if pool.layout == "layer_first":
        return kv[:, :, i : i + PAGE]
    if pool.layout == "page_first":
        return kv[:, i : i + PAGE].permute(0, 2, 1, 3, 4)
    if pool.layout == "page_first_direct":
        return kv[:, page]
    return kv[:, page].permute(0, 3, 2, 1, 4)  # page_head: (2, heads, P, layers, dim)


def test_factory_loads_our_class_from_the_dynamic_config(sock_dir: Path) -> None:
    """SGLang's StorageBackendFactory imports and builds the backend from extra_config."""
    config = owner_config(sock_dir, PAGE_BYTES, dtype="bfloat16", layout="layer_first")
    with OwnerThread(config):
        backend = create(config.socket_path)
        try:
            assert isinstance(backend, KvSidecarHiCacheStorage)
            assert isinstance(backend, hicache_storage.HiCacheStorage)
            assert backend.store_connected
        finally:
            backend.close()


@pytest.mark.parametrize("store_layout", STORE_LAYOUTS)
@pytest.mark.parametrize("host_layout", HOST_LAYOUTS)
def test_zero_copy_round_trip_is_byte_exact(
    sock_dir: Path, host_layout: str, store_layout: str
) -> None:
    """batch_set_v1 then batch_get_v1 move scattered host pages through the store unchanged."""
    src, dst = make_mha_host_pool(host_layout), make_mha_host_pool(host_layout)
    src.fill_random(seed=1)
    config = owner_config(sock_dir, PAGE_BYTES, dtype="bfloat16", layout=store_layout)
    keys, src_pages, dst_pages = page_keys(5), [3, 7, 1, 9, 0], [2, 5, 11, 4, 8]
    with OwnerThread(config):
        writer, reader = create(config.socket_path, src), create(config.socket_path, dst)
        try:
            assert writer.batch_set_v1(keys, src.host_indices(src_pages)) == [True] * 5
            assert reader.batch_exists(keys) == 5
            assert reader.batch_get_v1(keys, dst.host_indices(dst_pages)) == [True] * 5
            assert writer.counters()["blocks_stored"] == 5
            assert reader.counters()["blocks_loaded"] == 5
        finally:
            writer.close()
            reader.close()
    for s, d in zip(src_pages, dst_pages, strict=True):
        assert torch.equal(page_bytes(src, s), page_bytes(dst, d))
    untouched = set(range(16)) - set(dst_pages)
    assert all(not page_bytes(dst, p).any() for p in untouched)


@pytest.mark.parametrize("store_layout", ["layer_first", "page_first"])
def test_blocks_are_canonical_across_host_layouts(sock_dir: Path, store_layout: str) -> None:
    """A block written from a page-first pool reads into a layer-first pool as the same K/V."""
    src, dst = make_mha_host_pool("page_first"), make_mha_host_pool("layer_first")
    src.fill_random(seed=2)
    config = owner_config(sock_dir, PAGE_BYTES, dtype="bfloat16", layout=store_layout)
    keys = page_keys(3, start=100)
    with OwnerThread(config):
        writer, reader = create(config.socket_path, src), create(config.socket_path, dst)
        try:
            assert writer.batch_set_v1(keys, src.host_indices([4, 5, 6])) == [True] * 3
            assert reader.batch_get_v1(keys, dst.host_indices([0, 9, 3])) == [True] * 3
            with BlockStoreClient(config.socket_path) as plain:
                stored = plain.get(writer.keys.store_keys(keys[:1])[0])
        finally:
            writer.close()
            reader.close()
    for s, d in zip([4, 5, 6], [0, 9, 3], strict=True):
        assert torch.equal(logical_kv(src, s).view(torch.uint8),
                           logical_kv(dst, d).view(torch.uint8))
    # The block's bytes follow the store's declared order, built here from [kv, layer, ...].
    logical = logical_kv(src, 4)  # (2, layers, tokens, heads, dim)
    expected = (logical.permute(1, 0, 2, 3, 4) if store_layout == "layer_first"
                else logical.permute(2, 1, 0, 3, 4))
    assert np.array_equal(np.asarray(stored).view(np.uint8),
                          expected.contiguous().view(torch.uint8).numpy().reshape(-1))


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_generic_and_zero_copy_paths_agree(sock_dir: Path, host_layout: str) -> None:
    """Pages put through SGLang's generic path (flat data pages) read back through v1, and back."""
    src, mid, dst = (make_mha_host_pool(host_layout) for _ in range(3))
    src.fill_random(seed=3)
    config = owner_config(sock_dir, PAGE_BYTES, dtype="bfloat16", layout="layer_first")
    keys = page_keys(4, start=7)
    with OwnerThread(config):
        backend = create(config.socket_path, src)
        try:
            # _generic_page_set: flat data pages of the host pool.
            assert backend.batch_set(keys, [src.get_data_page(p * PAGE) for p in range(4)])
            backend.register_mem_pool_host(mid)
            assert backend.batch_get_v1(keys, mid.host_indices([8, 9, 10, 11])) == [True] * 4
            # _generic_page_get: dummy flat pages filled, then set_from_flat_data_page.
            backend.register_mem_pool_host(dst)
            pages = backend.batch_get(keys, [dst.get_dummy_flat_data_page() for _ in keys])
            for p, page in enumerate(pages):
                assert page is not None
                dst.set_from_flat_data_page(p * PAGE, page)
            assert backend.get(page_keys(1, start=999)[0], dst.get_dummy_flat_data_page()) is None
        finally:
            backend.close()
    for p in range(4):
        assert torch.equal(page_bytes(src, p), page_bytes(mid, 8 + p))
        assert torch.equal(page_bytes(src, p), page_bytes(dst, p))


def test_batch_exists_counts_only_the_leading_run(sock_dir: Path) -> None:
    """batch_exists is the number of consecutive held keys from the start."""
    pool = make_mha_host_pool("page_first")
    config = owner_config(sock_dir, PAGE_BYTES, dtype="bfloat16", layout="page_first")
    keys = page_keys(4, start=50)
    with OwnerThread(config):
        backend = create(config.socket_path, pool)
        try:
            held = [keys[0], keys[1], keys[3]]
            assert backend.batch_set_v1(held, pool.host_indices([0, 1, 3])) == [True] * 3
            assert backend.batch_exists(keys) == 2
            assert backend.batch_exists(keys[2:]) == 0
            assert backend.batch_exists([]) == 0
            assert backend.exists(keys[3]) and not backend.exists(keys[2])
            assert backend.batch_get_v1(keys, pool.host_indices([4, 5, 6, 7])) == [
                True, True, False, True]
            assert backend.counters()["blocks_missed"] == 1
        finally:
            backend.close()


def test_unreachable_store_is_a_logged_miss(sock_dir: Path) -> None:
    """With no owner on the socket, SGLang still builds the backend and every call misses."""
    pool = make_mha_host_pool("page_first")
    keys = page_keys(2)
    with capture_logs() as logs:
        backend = create(sock_dir / "nobody.sock", pool, retry_interval_s=60)
        try:
            assert backend.batch_exists(keys) == 0
            assert backend.batch_set_v1(keys, pool.host_indices([0, 1])) == [False, False]
            assert backend.batch_get_v1(keys, pool.host_indices([2, 3])) == [False, False]
            assert backend.batch_get(keys) == [None, None]
            assert backend.batch_set(keys, [pool.get_data_page(0), pool.get_data_page(4)]) is False
            assert backend.counters()["calls_unavailable"] >= 4
        finally:
            backend.close()
    unreachable = [e for e in logs if e["event"] == "store_unreachable"]
    assert len(unreachable) == 1 and "nobody.sock" in unreachable[0]["socket"]


@pytest.mark.slow
def test_owner_restart_is_survived(sock_dir: Path) -> None:
    """An owner process that dies turns calls into misses; its successor is picked up again."""
    pool = make_mha_host_pool("layer_first")
    pool.fill_random(seed=4)
    config = owner_config(sock_dir, PAGE_BYTES, dtype="bfloat16", layout="layer_first")
    keys = page_keys(2, start=300)
    owner = OwnerProcess(config).start()
    backend = create(config.socket_path, pool, retry_interval_s=0)
    try:
        assert backend.batch_set_v1(keys, pool.host_indices([0, 1])) == [True, True]
        owner.stop()
        with capture_logs() as logs:
            assert backend.batch_exists(keys) == 0
        assert any(e["event"] in ("store_lost", "store_unreachable") for e in logs)
        owner.start()  # a new owner: same id and socket, empty store
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys, pool.host_indices([0, 1])) == [True, True]
        assert backend.batch_exists(keys) == 2
        assert backend.counters()["connects"] >= 2
    finally:
        backend.close()
        owner.stop()


def test_store_geometry_mismatch_fails_at_registration(sock_dir: Path) -> None:
    """A store whose blocks are not one host page is refused when SGLang registers the pool."""
    pool = make_mha_host_pool("page_first")
    config = owner_config(sock_dir, PAGE_BYTES * 2, dtype="bfloat16", layout="page_first")
    with OwnerThread(config):
        backend = create(config.socket_path)
        try:
            with pytest.raises(StoreMismatchError, match=f"--block-bytes {PAGE_BYTES}"):
                backend.register_mem_pool_host(pool)
        finally:
            backend.close()
    wrong_dtype = owner_config(sock_dir, PAGE_BYTES, dtype="float16", layout="page_first")
    with OwnerThread(wrong_dtype):
        backend = create(wrong_dtype.socket_path)
        try:
            with pytest.raises(StoreMismatchError, match="float16 blocks"):
                backend.register_mem_pool_host(pool)
        finally:
            backend.close()


def test_bad_extra_config_is_refused_by_name(sock_dir: Path) -> None:
    """A typo in our extra_config keys fails SGLang's backend creation with the known keys."""
    with pytest.raises(ValueError, match=r"unknown extra_config keys \['sockt'\]"):
        backend_factory.StorageBackendFactory.create_backend(
            "dynamic", storage_config(sock_dir / "x.sock", sockt="/x"), None)


def test_bad_host_indices_are_a_counted_miss(sock_dir: Path) -> None:
    """Host indices that do not cover the keys' pages store nothing and are counted."""
    pool = make_mha_host_pool("page_first")
    config = owner_config(sock_dir, PAGE_BYTES, dtype="bfloat16", layout="page_first")
    keys = page_keys(2, start=70)
    with OwnerThread(config):
        backend = create(config.socket_path, pool)
        try:
            with capture_logs() as logs:
                assert backend.batch_set_v1(keys, pool.host_indices([0])) == [False, False]
                assert backend.batch_set_v1(keys, pool.host_indices([0, 1]) + 1) == [False] * 2
            assert backend.batch_exists(keys) == 0
            assert backend.counters()["bad_requests"] == 2
            assert [e["event"] for e in logs] == ["hicache_request_rejected"] * 2
        finally:
            backend.close()


@pytest.mark.slow  # real processes, seconds a test
def test_real_sglang_host_pool_class_round_trip(sock_dir: Path) -> None:
    """SGLang's own MHATokenToKVPoolHost round-trips pages byte-exact, in both layouts.

    It imports on this CPU machine with SGLang's Python dependencies installed without their
    CUDA ones (``./scripts/test`` does) and its two torchvision-bound vision modules stubbed
    (``tests/support/sglang_shim.py``); where those dependencies are missing it is skipped
    with the import error.
    """
    script = Path(__file__).with_name("real_sglang_pool_check.py")
    config = owner_config(sock_dir, PAGE_BYTES, dtype="bfloat16", layout="layer_first")
    with OwnerThread(config):
        done = subprocess.run([sys.executable, str(script), str(config.socket_path),
                               "page_first", "layer_first"],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    if done.returncode == 77:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr[-2000:]
