"""Pages of an SGLang host KV pool as strided views in the block store's byte order.

A store block is one page. Its bytes follow the store's declared layout
(``kvcore.layout``), whatever layout the engine's host pool uses:

* ``layer_first``: ``[layer][k|v][token][kv_head][head_dim]``;
* ``page_first``: ``[token][layer][k|v][kv_head][head_dim]``;
* ``raw``: the pool's own flat page order (what SGLang's ``get_data_page(flat=True)``
  gives), so blocks are only exchangeable between pools of the same layout.

SGLang's MHA host pools (``MHATokenToKVPoolHost``) expose their geometry (``kv_buffer``,
``layout``, ``layer_num``, ``head_num``, ``head_dim``, ``page_size``), so their pages become
numpy views over ``kv_buffer`` in block order and one ``numpy.copyto`` moves a page
straight between the pool and a store slot, for every host layout:

=====================  ===========================================  ==================
host ``layout``        ``kv_buffer`` dims                           page of index ``i``
=====================  ===========================================  ==================
``layer_first``        ``(2, layers, tokens, heads, dim)``          tokens ``i:i+P``
``page_first``         ``(2, tokens, layers, heads, dim)``          tokens ``i:i+P``
``page_first_direct``  ``(2, pages, layers, P, heads, dim)``        page ``i // P``
``page_head``          ``(2, pages, heads, P, layers, dim)``        page ``i // P``
=====================  ===========================================  ==================

Any other pool with SGLang's flat-page surface (``get_data_page``,
``set_from_flat_data_page``, ``get_dummy_flat_data_page``; the reference engine's
``HostKVPool``, SGLang's MLA pools) is *opaque*: its pages move as flat bytes, which only a
``raw`` store can hold without misnaming their order.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from adapters.storage.link import StoreMismatchError

__all__ = ["BLOCK_ORDERS", "HostPages", "host_pages_for"]

_KV, _LAYER, _TOKEN, _HEAD, _DIM, _PAGE = "kv", "layer", "token", "head", "dim", "page"

#: Dim names of a block, per store layout (``raw`` is the pool's own order).
BLOCK_ORDERS: dict[str, tuple[str, ...]] = {
    "layer_first": (_LAYER, _KV, _TOKEN, _HEAD, _DIM),
    "page_first": (_TOKEN, _LAYER, _KV, _HEAD, _DIM),
}

#: Dim names of ``kv_buffer`` once its token axis is split into ``(page, token)``.
_POOL_DIMS: dict[str, tuple[str, ...]] = {
    "layer_first": (_KV, _LAYER, _PAGE, _TOKEN, _HEAD, _DIM),
    "page_first": (_KV, _PAGE, _TOKEN, _LAYER, _HEAD, _DIM),
    "page_first_direct": (_KV, _PAGE, _LAYER, _TOKEN, _HEAD, _DIM),
    "page_head": (_KV, _PAGE, _HEAD, _TOKEN, _LAYER, _DIM),
}


def _u8(tensor: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a CPU tensor (the last dim widens by the element size)."""
    if tensor.device.type != "cpu":
        raise StoreMismatchError(f"host pool tensors must be in CPU memory, got {tensor.device}")
    return tensor.view(torch.uint8).numpy()


class HostPages:
    """Copies between one host pool's pages and flat store blocks (uint8 arrays)."""

    def __init__(self, pool: Any, store_layout: str) -> None:
        self.pool = pool
        self.page_size = int(pool.page_size)
        self.dtype: torch.dtype = pool.dtype
        self.store_layout = store_layout
        self._pages: np.ndarray | None = None  # (page, *block dims) view of kv_buffer
        self._flat_shape: tuple[int, ...] = ()  # a flat page, unflattened (native order)
        self._flat_perm: tuple[int, ...] = ()  # native order → block order
        if _is_mha(pool):
            self._init_mha(pool, store_layout)
            self.bytes_per_page = int(np.prod(self._flat_shape))
            self.kind = "mha"
        else:
            if store_layout != "raw":
                raise StoreMismatchError(
                    f"host pool {type(pool).__name__} does not expose its KV geometry "
                    f"(kv_buffer, layout, layer_num, head_num, head_dim), so its pages cannot "
                    f"be written in the store's {store_layout!r} order; run the store with "
                    "--layout raw for this engine (the sidecar's --store-layout raw)"
                )
            dummy = pool.get_dummy_flat_data_page()
            self.bytes_per_page = dummy.numel() * dummy.element_size()
            self._flat_shape = (self.bytes_per_page,)
            self._flat_perm = (0,)
            self.kind = "opaque"
        self.block_shape = tuple(self._flat_shape[i] for i in self._flat_perm)

    def _init_mha(self, pool: Any, store_layout: str) -> None:
        dims = _POOL_DIMS[pool.layout]
        buf = _u8(pool.kv_buffer)  # last dim: head_dim * itemsize bytes
        if pool.layout in ("layer_first", "page_first"):
            axis = dims.index(_PAGE)  # split the token axis into (page, token)
            shape = list(buf.shape)
            shape[axis : axis + 1] = [shape[axis] // self.page_size, self.page_size]
            buf = buf.view()
            buf.shape = shape  # raises rather than copy if kv_buffer is not contiguous
        native = tuple(d for d in dims if d != _PAGE)
        order = BLOCK_ORDERS.get(store_layout, native)
        self._pages = buf.transpose([dims.index(_PAGE), *(dims.index(d) for d in order)])
        self._flat_shape = tuple(buf.shape[dims.index(d)] for d in native)
        self._flat_perm = tuple(native.index(d) for d in order)

    # ---------------------------------------------------------------- pages
    def page_numbers(self, host_indices: Any, num_keys: int) -> list[int]:
        """The page of each key: ``host_indices`` holds ``page_size`` token slots per key."""
        indices = torch.as_tensor(host_indices).reshape(-1)
        if indices.numel() != num_keys * self.page_size:
            raise ValueError(
                f"{indices.numel()} host indices for {num_keys} keys of {self.page_size} tokens"
            )
        firsts = indices[:: self.page_size]
        if bool((firsts % self.page_size).any()):
            raise ValueError("host indices do not start on page boundaries")
        return (firsts // self.page_size).tolist()

    def save(self, page: int, slot: np.ndarray) -> None:
        """Copy a page into a store slot (a writable flat uint8 view)."""
        if self._pages is not None:
            np.copyto(slot.reshape(self.block_shape), self._pages[page])
            return
        data = self.pool.get_data_page(page * self.page_size, flat=True)
        np.copyto(slot, _u8(data.contiguous()).reshape(-1))

    def load(self, page: int, block: np.ndarray) -> None:
        """Copy a store block (a flat uint8 view, read-only is fine) into a page."""
        if self._pages is not None:
            np.copyto(self._pages[page], block.reshape(self.block_shape))
            return
        index = page * self.page_size
        target = self.pool.get_data_page(index, flat=True)
        if _shares_memory(target, self.pool):
            np.copyto(_u8(target).reshape(-1), block)
            return
        staged = torch.empty(self.bytes_per_page, dtype=torch.uint8)  # an unusual pool
        staged.numpy()[:] = block
        self.pool.set_from_flat_data_page(index, staged.view(self.dtype))

    # ----------------------------------------------------- flat pages (generic API)
    def flat_as_block(self, flat: torch.Tensor) -> np.ndarray:
        """A flat page tensor (native order, as ``get_data_page`` gives) viewed in block order."""
        raw = _u8(flat.contiguous()).reshape(-1)
        if raw.size != self.bytes_per_page:
            raise ValueError(f"a page is {self.bytes_per_page} bytes, got {raw.size}")
        return raw.reshape(self._flat_shape).transpose(self._flat_perm)

    def new_flat_page(self) -> torch.Tensor:
        return torch.empty(self.bytes_per_page // self.dtype.itemsize, dtype=self.dtype)


def _is_mha(pool: Any) -> bool:
    buf = getattr(pool, "kv_buffer", None)
    layout = getattr(pool, "layout", None)
    if not isinstance(buf, torch.Tensor) or layout not in _POOL_DIMS:
        return False
    if any(not hasattr(pool, a) for a in ("layer_num", "head_num", "head_dim", "page_size")):
        return False
    if getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
        return False  # asymmetric K/V widths: no single block shape
    return buf.dim() == len(_POOL_DIMS[layout]) - (1 if layout in ("layer_first",
                                                                    "page_first") else 0)


def _shares_memory(tensor: torch.Tensor, pool: Any) -> bool:
    buf = getattr(pool, "kv_buffer", None)
    return (
        isinstance(buf, torch.Tensor)
        and tensor.is_contiguous()
        and tensor.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    )


def host_pages_for(pool: Any, store_layout: str, store_dtype: str, block_bytes: int) -> HostPages:
    """``HostPages`` for ``pool``, checked against the store's geometry."""
    pages = HostPages(pool, store_layout)
    dtype = str(pages.dtype).removeprefix("torch.")
    if store_dtype not in (dtype, "uint8"):
        raise StoreMismatchError(
            f"the store holds {store_dtype} blocks; this engine's host pool is {dtype}"
        )
    if block_bytes != pages.bytes_per_page:
        raise StoreMismatchError(
            f"the store's blocks are {block_bytes} bytes; a host page of this engine is "
            f"{pages.bytes_per_page} bytes (page_size × layers × 2 × kv heads × head_dim × "
            f"dtype bytes): start the store with --block-bytes {pages.bytes_per_page}"
        )
    return pages
