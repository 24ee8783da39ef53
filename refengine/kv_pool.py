"""The device KV pool: a fixed set of pages and the bytes behind them.

``PageAllocator`` hands out page ids (``--max-total-tokens // --page-size`` of them) and
takes them back; it knows nothing about prefixes. A *KV store* (:class:`KVStore`) holds the
bytes: ``TorchKVStore`` (:mod:`refengine.torch_compute`) keeps per-layer K and V tensors of
``[slots, kv_heads, head_dim]`` for the torch model (slot = ``page * page_size + offset``);
``SimKVStore`` keeps nothing and hands out placeholder pages of the configured byte size, for
simulated compute. Both move whole pages to and from flat tensors in one fixed layout (``[2
(K,V), layers, page_size, kv_heads, head_dim]``), which is what the host tier and page export
see. This module loads no torch until a page is moved (:func:`torch_dtype`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from refengine.presets import ModelConfig

if TYPE_CHECKING:
    import torch

__all__ = ["KVStore", "PageAllocator", "SimKVStore", "torch_dtype"]


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

    @property
    def dtype(self) -> torch.dtype: ...

    def read_pages(self, pages: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, page_numel]`` copy of the pages' KV in the fixed page layout (into ``out``
        when given, a contiguous ``[n, page_numel]`` tensor)."""
        ...

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        """Fill pages from ``[n, page_numel]`` data in the fixed page layout."""
        ...


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``ModelConfig.torch_dtype`` name.

    torch is imported here, on first use, not with the module: a simulated engine that moves
    no pages (no host tier) never loads it, which saves seconds at every start.
    """
    import torch  # noqa: PLC0415 - see above

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class SimKVStore:
    """No KV bytes on the device side: simulated compute. Pages read back as a placeholder
    of the configured size whose first element is the page id (so a round trip is checkable).
    """

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self._dtype = cfg.torch_dtype
        self.page_numel = (
            2 * cfg.num_hidden_layers * page_size * cfg.num_key_value_heads * cfg.head_dim
        )

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self._dtype)

    def read_pages(self, pages: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        import torch  # noqa: PLC0415 - only a host tier moves pages; it has loaded torch

        if out is None:
            out = torch.empty((len(pages), self.page_numel), dtype=self.dtype)
        out.zero_()
        out[:, 0] = torch.tensor(pages, dtype=self.dtype)
        return out

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        if data.shape != (len(pages), self.page_numel):
            raise ValueError(f"page data shape {tuple(data.shape)} does not match the pool")
