"""The device KV pool: a fixed set of pages and the bytes behind them.

``PageAllocator`` hands out page ids (``--max-total-tokens // --page-size`` of them) and
takes them back; it knows nothing about prefixes. A *KV store* holds the bytes:
``TorchKVStore`` keeps per-layer K and V tensors of ``[slots, kv_heads, head_dim]`` for the
torch model (slot = ``page * page_size + offset``); ``SimKVStore`` keeps nothing and hands out
placeholder pages of the configured byte size, for simulated compute. Both move whole pages
to and from flat tensors in one fixed layout (``[2 (K,V), layers, page_size, kv_heads,
head_dim]``), which is what the host tier and page export see.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from refengine.presets import ModelConfig

__all__ = ["KVStore", "PageAllocator", "SimKVStore", "TorchKVStore"]


class PageAllocator:
    """Free list of page ids; allocation is all-or-nothing."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._used = [False] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._used[p] = True
        return pages

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            if not self._used[p]:
                raise RuntimeError(f"page {p} freed twice")
            self._used[p] = False
            self._free.append(p)


class KVStore(Protocol):
    """Bytes behind the device pages."""

    page_size: int
    page_numel: int
    dtype: torch.dtype

    def read_pages(self, pages: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, page_numel]`` copy of the pages' KV in the fixed page layout (into ``out``
        when given, a contiguous ``[n, page_numel]`` tensor)."""
        ...

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        """Fill pages from ``[n, page_numel]`` data in the fixed page layout."""
        ...


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchKVStore:
    """One pre-faulted tensor ``[pages, 2 (K,V), layers, page_size, kv_heads, head_dim]``: a
    page's KV is contiguous, so exporting or importing pages is a single gather or scatter.
    The model sees per-layer views ``[pages, page_size, kv_heads, head_dim]`` (``k_cache[l]``,
    ``v_cache[l]``) and addresses token slot ``s`` as ``[s // page_size, s % page_size]``.
    """

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.dtype = _TORCH_DTYPES[cfg.torch_dtype]
        self.layers = cfg.num_hidden_layers
        self.kv_heads, self.head_dim = cfg.num_key_value_heads, cfg.head_dim
        shape = (num_pages, 2, self.layers, page_size, self.kv_heads, self.head_dim)
        # zeros() touches every page now, so the first requests do not pay for page faults.
        self.kv = torch.zeros(shape, dtype=self.dtype)
        self.k_cache = [self.kv[:, 0, layer] for layer in range(self.layers)]
        self.v_cache = [self.kv[:, 1, layer] for layer in range(self.layers)]
        self.page_numel = 2 * self.layers * page_size * self.kv_heads * self.head_dim

    def _flat(self) -> torch.Tensor:
        return self.kv.view(self.kv.shape[0], self.page_numel)

    def read_pages(self, pages: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        idx = torch.tensor(pages, dtype=torch.long)
        if out is None:
            return self._flat().index_select(0, idx)
        return torch.index_select(self._flat(), 0, idx, out=out)  # straight into ``out``

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        idx = torch.tensor(pages, dtype=torch.long)
        self._flat().index_copy_(0, idx, data.reshape(len(pages), self.page_numel).to(self.dtype))


class SimKVStore:
    """No KV bytes on the device side: simulated compute. Pages read back as a placeholder
    of the configured size whose first element is the page id (so a round trip is checkable).
    """

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.dtype = _TORCH_DTYPES[cfg.torch_dtype]
        self.page_numel = (
            2 * cfg.num_hidden_layers * page_size * cfg.num_key_value_heads * cfg.head_dim
        )

    def read_pages(self, pages: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty((len(pages), self.page_numel), dtype=self.dtype)
        out.zero_()
        out[:, 0] = torch.tensor(pages, dtype=self.dtype)
        return out

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        if data.shape != (len(pages), self.page_numel):
            raise ValueError(f"page data shape {tuple(data.shape)} does not match the pool")
