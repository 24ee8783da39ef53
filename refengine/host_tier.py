"""The host-tier hook: an external page store behind SGLang's HiCache storage interface.

SGLang's HiCache talks to an L3 store through ``HiCacheStorage``
(``sglang/srt/mem_cache/hicache_storage.py``): the controller registers a *host KV pool*, then
moves pages with ``batch_set_v1(keys, host_indices)`` / ``batch_get_v1(keys, host_indices)``
(``host_indices``: token-slot indices into the host pool, ``page_size`` per key) after asking
``batch_exists(keys)`` how many leading pages the store has. Keys are the 64-hex SHA-256 page
hashes (:mod:`refengine.page_hash`). :class:`PageStore` is that surface; a backend written for
SGLang's ``dynamic`` factory (``cls(storage_config, {})`` then ``register_mem_pool_host``)
plugs into this engine unchanged, and vice versa.

Shipped backends: :class:`InProcessPageStore` (a dict, for tests and single-process setups)
and :class:`FilePageStore` (one file per page in a directory, like SGLang's ``file`` backend;
lets two engine processes share pages, e.g. prefill → decode).
"""

from __future__ import annotations

import importlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "FilePageStore",
    "HostKVPool",
    "InProcessPageStore",
    "PageStore",
    "StorageConfig",
    "StorageExtraInfo",
    "create_page_store",
]

STORAGE_BATCH_SIZE = 128  # pages per call, as SGLang's controller


@dataclass(frozen=True, slots=True)
class StorageExtraInfo:
    """``HiCacheStorageExtraInfo``: the keys before this call's, so the two form one chain."""

    prefix_keys: list[str] | None = None
    extra_info: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """The fields of SGLang's ``HiCacheStorageConfig`` a single-rank engine fills in."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = True
    model_name: str | None = None
    tp_lcm_size: int | None = None
    should_split_heads: bool = False
    dp_rank: int = 0
    extra_config: dict[str, Any] | None = field(default=None)
    dcp_size: int = 1
    dcp_rank: int = 0
    logical_page_size: int | None = None


class HostKVPool:
    """Host staging buffer the store reads from and writes to (SGLang's ``HostKVCache``
    surface: ``page_size``, ``layout``, ``get_data_page``, ``set_from_flat_data_page``,
    ``get_page_buffer_meta``). A page is ``page_numel`` elements laid out
    ``[2 (K,V), layers, page_size, kv_heads, head_dim]``; buffer meta gives 2 pointers per page
    (its K half and V half), as SGLang's page-first MHA pool does.
    """

    layout = "page_first"

    def __init__(self, num_pages: int, page_size: int, page_numel: int, dtype: torch.dtype):
        self.page_size = page_size
        self.page_numel = page_numel
        self.dtype = dtype
        self.num_pages = num_pages
        self.kv_buffer = torch.zeros((num_pages, page_numel), dtype=dtype)  # pre-faulted
        self._free = list(range(num_pages - 1, -1, -1))

    def alloc(self, n: int) -> torch.Tensor:
        """Token-slot indices (``page_size`` per page) of ``n`` free host pages."""
        if n > len(self._free):
            raise MemoryError(f"host staging pool: asked for {n} pages, {len(self._free)} free")
        pages = torch.tensor([self._free.pop() for _ in range(n)], dtype=torch.long)
        return (pages.unsqueeze(1) * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def free(self, host_indices: torch.Tensor) -> None:
        # Pushed back in reverse so the next alloc pops them in ascending order again:
        # consecutive rows let the tier copy through a view instead of a gather.
        self._free.extend(reversed(self.page_rows(host_indices).tolist()))

    def page_rows(self, host_indices: torch.Tensor) -> torch.Tensor:
        return host_indices[:: self.page_size] // self.page_size

    def pages_view(self, host_indices: torch.Tensor) -> torch.Tensor | None:
        """The ``[n, page_numel]`` buffer rows of these slots as a view, if consecutive."""
        rows = self.page_rows(host_indices)
        first = int(rows[0])
        if torch.equal(rows, torch.arange(first, first + len(rows))):
            return self.kv_buffer[first : first + len(rows)]
        return None

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[int(index) // self.page_size]
        return page if flat else page.view(2, -1)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.page_numel, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[int(index) // self.page_size].copy_(data_page.view(self.dtype))

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        half = self.page_numel // 2 * self.kv_buffer.element_size()
        ptrs, sizes = [], []
        for row in self.page_rows(indices).tolist():
            base = self.kv_buffer[row].data_ptr()
            ptrs += [base, base + half]
            sizes += [half, half]
        return ptrs, sizes


@runtime_checkable
class PageStore(Protocol):
    """The part of SGLang's ``HiCacheStorage`` the engine calls."""

    def register_mem_pool_host(self, mem_pool_host: Any) -> None: ...

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int: ...

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]: ...

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]: ...

    def clear(self) -> None: ...


class InProcessPageStore:
    """Pages in a dict, copied in and out of the registered host pool."""

    def __init__(self, storage_config: StorageConfig | None = None, kwargs: Any = None) -> None:
        self.config = storage_config or StorageConfig()
        self.mem_pool_host: HostKVPool | None = None
        self._pages: dict[str, torch.Tensor] = {}

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host

    def _pool(self) -> HostKVPool:
        if self.mem_pool_host is None:
            raise RuntimeError("register_mem_pool_host was not called")
        return self.mem_pool_host

    def exists(self, key: str) -> bool:
        return key in self._pages

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        for i, key in enumerate(keys):
            if key not in self._pages:
                return i
        return len(keys)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        pool = self._pool()
        for i, key in enumerate(keys):
            if key not in self._pages:
                self._pages[key] = pool.get_data_page(int(host_indices[i * pool.page_size])).clone()
        return [True] * len(keys)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        pool = self._pool()
        out = []
        for i, key in enumerate(keys):
            page = self._pages.get(key)
            if page is not None:
                pool.set_from_flat_data_page(int(host_indices[i * pool.page_size]), page)
            out.append(page is not None)
        return out

    def clear(self) -> None:
        self._pages.clear()

    def get_stats(self) -> dict[str, int]:
        return {"pages": len(self._pages)}


class FilePageStore(InProcessPageStore):
    """One file per page, ``<dir>/<key>_<model_name>.bin``, written atomically (temp file +
    rename), so concurrent engines never see a torn page. ``extra_config["file_path"]`` names
    the directory."""

    def __init__(self, storage_config: StorageConfig | None = None, kwargs: Any = None) -> None:
        super().__init__(storage_config, kwargs)
        extra = self.config.extra_config or {}
        path = extra.get("file_path")
        if not path:
            raise ValueError('the file page store needs extra_config {"file_path": DIR}')
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.suffix = f"_{self.config.model_name or 'model'}.bin"

    def _file(self, key: str) -> Path:
        return self.root / f"{key}{self.suffix}"

    def exists(self, key: str) -> bool:
        return self._file(key).exists()

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        for i, key in enumerate(keys):
            if not self._file(key).exists():
                return i
        return len(keys)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        pool = self._pool()
        for i, key in enumerate(keys):
            target = self._file(key)
            if target.exists():
                continue
            data = pool.get_data_page(int(host_indices[i * pool.page_size])).contiguous()
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(data.view(torch.uint8).numpy().tobytes())
            os.replace(tmp, target)
        return [True] * len(keys)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        pool = self._pool()
        out = []
        for i, key in enumerate(keys):
            try:
                raw = self._file(key).read_bytes()
            except FileNotFoundError:
                out.append(False)
                continue
            page = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            ok = page.numel() == pool.page_numel * pool.kv_buffer.element_size()
            if ok:
                pool.set_from_flat_data_page(int(host_indices[i * pool.page_size]), page)
            out.append(ok)
        return out

    def clear(self) -> None:
        for file in self.root.glob(f"*{self.suffix}"):
            file.unlink(missing_ok=True)


def create_page_store(backend: str, config: StorageConfig) -> PageStore:
    """Build a backend by name: ``memory``, ``file``, or ``dynamic`` (SGLang's factory rule:
    extra_config names ``module_path`` and ``class_name``; built as ``cls(config, {})``)."""
    if backend == "memory":
        return InProcessPageStore(config, {})
    if backend == "file":
        return FilePageStore(config, {})
    if backend == "dynamic":
        extra = config.extra_config or {}
        missing = [k for k in ("backend_name", "module_path", "class_name") if k not in extra]
        if missing:
            raise ValueError(f"dynamic storage backend: extra_config lacks {missing}")
        try:
            cls = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"dynamic storage backend cannot be loaded: {exc}") from exc
        store = cls(config, {})
        if not isinstance(store, PageStore):
            raise ValueError(f"{extra['class_name']} does not implement the page-store interface")
        return store
    raise ValueError(f"unknown storage backend {backend!r}; use memory, file or dynamic")
