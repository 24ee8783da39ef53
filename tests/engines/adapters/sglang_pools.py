"""SGLang's MHA host KV pool, built on CPU from the installed sglang's own code.

``sglang.srt.mem_cache.pool_host`` cannot be imported on these CPU machines: its package
``__init__`` imports ``memory_pool`` → ``sglang.srt.configs`` (every model config) →
``sglang.srt.multimodal.internvl_utils`` → ``torchvision``, and PyPI's only torchvision
wheels for torch 2.13 are CUDA builds that fail to load against the CPU torch
(``RuntimeError: operator torchvision::nms does not exist``); ``memory_pool`` also imports
``tvm_ffi`` and ``transformers``.

So the smallest real piece that runs is taken instead: the methods of
``MHATokenToKVPoolHost`` that define and address the host buffer (``init_kv_buffer``,
``get_data_page``, ``set_from_flat_data_page``, ``get_dummy_flat_data_page``,
``get_page_buffer_meta``, ``get_size_per_token``, ``k_buffer``, ``v_buffer``) are read from
the installed ``sglang/srt/mem_cache/pool_host/mha.py`` and compiled unchanged onto a small
class that sets the attributes ``HostKVCache.__init__`` would (sizes, layout, device). Only
the allocator differs: ``ALLOC_MEMORY_FUNCS`` (``cudaHostRegister``) becomes a plain CPU
``torch.zeros``. If sglang changes a buffer layout, these pools change with it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import torch

_METHODS = frozenset({
    "init_kv_buffer", "get_data_page", "set_from_flat_data_page", "get_dummy_flat_data_page",
    "get_page_buffer_meta", "get_size_per_token", "k_buffer", "v_buffer",
})


def _cpu_alloc(dims: tuple[int, ...], *, dtype: torch.dtype, device: str, pin_memory: bool,
               allocator: Any, registration_granularity_bytes: int | None) -> torch.Tensor:
    return torch.zeros(dims, dtype=dtype, device=device)


class _AllocFuncs(dict[str, Any]):
    def __missing__(self, key: str) -> Any:
        return _cpu_alloc


def sglang_mha_methods() -> type:
    """A class holding ``MHATokenToKVPoolHost``'s buffer methods from the installed sglang."""
    import sglang

    path = Path(sglang.__file__).parent / "srt" / "mem_cache" / "pool_host" / "mha.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body
               if isinstance(n, ast.ClassDef) and n.name == "MHATokenToKVPoolHost")
    body: list[ast.stmt] = [n for n in cls.body
                            if isinstance(n, ast.FunctionDef) and n.name in _METHODS]
    found = {n.name for n in body if isinstance(n, ast.FunctionDef)}
    if found != _METHODS:
        raise RuntimeError(f"sglang's MHATokenToKVPoolHost lacks {sorted(_METHODS - found)}")
    module = ast.Module(body=[ast.ClassDef(name="SGLangMHAHostMethods", bases=[], keywords=[],
                                           body=body, decorator_list=[])], type_ignores=[])
    ast.fix_missing_locations(module)
    namespace: dict[str, Any] = {"torch": torch, "ALLOC_MEMORY_FUNCS": _AllocFuncs(),
                                 "__name__": "sglang_mha_host_methods"}
    exec(compile(module, str(path), "exec"), namespace)
    return namespace["SGLangMHAHostMethods"]  # type: ignore[no-any-return]


def make_mha_host_pool(layout: str, *, layers: int = 3, heads: int = 2, head_dim: int = 8,
                       page_size: int = 4, num_pages: int = 16,
                       dtype: torch.dtype = torch.bfloat16) -> Any:
    """An MHA host pool in ``layout`` whose buffer SGLang's own ``init_kv_buffer`` shaped."""
    methods = sglang_mha_methods()

    class CpuMHAHostPool(methods):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            self.layout = layout
            self.layer_num, self.head_num = layers, heads
            self.head_dim = self.v_head_dim = head_dim
            self.page_size, self.page_num = page_size, num_pages
            self.size = page_size * num_pages
            self.dtype, self.device, self.pin_memory, self.allocator = dtype, "cpu", False, None
            self._transfer_device = torch.device("cpu")
            self.kv_buffer = self.init_kv_buffer()

        def host_indices(self, pages: list[int]) -> torch.Tensor:
            """Token slots of ``pages``, ``page_size`` per page, as the host allocator gives."""
            rows = torch.tensor(pages, dtype=torch.int64)
            return (rows[:, None] * page_size + torch.arange(page_size)).reshape(-1)

        def fill_random(self, seed: int) -> None:
            gen = torch.Generator().manual_seed(seed)
            raw = self.kv_buffer.view(torch.uint8)
            # Random bytes, but never a bf16 NaN pattern that could compare unequal by value.
            raw.copy_(torch.randint(0, 127, raw.shape, generator=gen, dtype=torch.uint8))

    return CpuMHAHostPool()
