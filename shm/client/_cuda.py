"""A client's mapping registered with CUDA, so block copies to and from GPU tensors DMA
straight to and from the segment.

Copying a CUDA tensor into pageable host memory goes through the driver's staging buffers
one chunk at a time. Measured on an H200 (``scripts/bench_shm_cuda.py``, 64 blocks per
batch, one copy per block): 2 MiB blocks moved to the segment at 8 GB/s and back at 5 GB/s
from pageable memory, 29 and 32 GB/s once the segment was registered
(``cudaHostRegister``), against 40 GB/s for a pinned buffer of the process; 256 KiB blocks
4 and 3 GB/s pageable, 8 and 8 registered, 15 and 14 pinned. So the first time a client
copies a CUDA tensor it registers its whole mapping, once. If that fails (e.g. a
locked-memory limit), it logs it once and copies as before. torch is imported only once a
tensor is seen.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog

__all__ = ["CudaMapping"]

log = structlog.get_logger(component="shm")


class CudaMapping:
    """Registers ``slots`` (the mapped data region, every slot whole) with CUDA on first use."""

    def __init__(self, slots: np.ndarray, *, enabled: bool = True) -> None:
        """``enabled=False``: never register (GPU copies go through pageable memory)."""
        self._base = slots.ctypes.data
        self._size = slots.nbytes
        self._registered: bool | None = None if enabled else False  # None: not tried yet

    def prepare(self, arrays: Sequence[Any]) -> None:
        """Register the mapping the first time CUDA tensors are about to be copied."""
        if self._registered is not None or "torch" not in sys.modules:
            return
        if any(getattr(a, "is_cuda", False) for a in arrays):
            self._registered = self._register()

    def _register(self) -> bool:
        import torch  # noqa: PLC0415 - a CUDA tensor was seen, so torch is loaded

        err = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
            self._base, self._size, 0)
        if int(err) != 0:
            log.warning("shm_cuda_register_failed", error=str(err), size_bytes=self._size,
                        hint="copies to and from GPU tensors stay on pageable memory")
            return False
        log.info("shm_cuda_registered", size_bytes=self._size)
        return True

    def close(self) -> None:
        """Unregister (before the mapping goes away); idempotent."""
        if self._registered:
            import torch  # noqa: PLC0415

            torch.cuda.cudart().cudaHostUnregister(self._base)  # type: ignore[no-untyped-call]
        self._registered = False
