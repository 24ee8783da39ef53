"""Checks and copies between callers' arrays (numpy, or torch when installed) and slot views.

The store's blocks are flat runs of ``block_bytes``. A caller's array fits a block when its
byte size is ``block_bytes`` and its dtype is the store's dtype, or ``uint8`` (raw block
bytes: the way to move dtypes numpy lacks, such as bfloat16, through numpy). Copies go
straight between the caller's memory and the mapped slot (``numpy.copyto``, or
``Tensor.copy_`` for torch, which also copies device tensors to and from host memory).
torch is imported only when a tensor is seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shm.errors import BlockDtypeError, BlockSizeError

__all__ = ["BlockFormat"]


_U8 = np.dtype(np.uint8)


def _is_torch(obj: object) -> bool:
    return type(obj).__module__.split(".", 1)[0] == "torch"


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """A store's block size and dtype, and the copies that respect them."""

    block_bytes: int
    dtype: str

    def check(self, array: Any, what: str = "block") -> Any:
        """``array`` (bytes-likes become uint8 arrays) if it fits a block, else a typed error."""
        if (  # the common case, kept cheap: a numpy array of the right size and dtype
            type(array) is np.ndarray
            and array.nbytes == self.block_bytes
            and (array.dtype is _U8 or array.dtype.name == self.dtype)
        ):
            return array
        if isinstance(array, np.ndarray) or _is_torch(array):
            pass
        elif isinstance(array, bytes | bytearray | memoryview):
            array = np.frombuffer(array, dtype=np.uint8)
        else:
            raise BlockDtypeError(
                f"{what} is a {type(array).__name__}; expected a numpy array, a torch tensor "
                "or a bytes-like object"
            )
        if _is_torch(array):
            nbytes = array.numel() * array.element_size()
            dtype = str(array.dtype).removeprefix("torch.")
        else:
            nbytes, dtype = array.nbytes, array.dtype.name
        if dtype not in (self.dtype, "uint8"):
            raise BlockDtypeError(
                f"{what} has dtype {dtype}; this store holds {self.dtype} (or raw uint8) blocks"
            )
        if nbytes != self.block_bytes:
            raise BlockSizeError(
                f"{what} is {nbytes} bytes; this store's blocks are {self.block_bytes} bytes"
            )
        return array

    def new_array(self) -> np.ndarray:
        """A fresh flat array for one block: the store's dtype when numpy has it, else uint8."""
        try:
            dtype = np.dtype(self.dtype)
        except TypeError:
            dtype = np.dtype(np.uint8)
        return np.empty(self.block_bytes // dtype.itemsize, dtype=dtype)

    @staticmethod
    def write(rows: np.ndarray, slot: int, src: Any) -> None:
        """Copy a checked block into slot ``slot`` of ``rows`` (uint8, one row per slot)."""
        if type(src) is np.ndarray:
            if src.dtype is _U8 and src.ndim == 1:
                rows[slot] = src
            elif src.flags.c_contiguous:
                rows[slot] = src.reshape(-1).view(np.uint8)
            else:
                np.copyto(rows[slot].view(src.dtype).reshape(src.shape), src)
            return
        import torch  # noqa: PLC0415 - optional, only once a tensor is seen

        torch.from_numpy(rows[slot]).view(src.dtype).view(src.shape).copy_(src)

    @staticmethod
    def read(rows: np.ndarray, slot: int, dst: Any) -> None:
        """Copy slot ``slot`` of ``rows`` into a checked, writable block array."""
        if type(dst) is np.ndarray:
            if dst.dtype is _U8 and dst.ndim == 1:
                dst[:] = rows[slot]
            elif dst.flags.c_contiguous:
                dst.reshape(-1).view(np.uint8)[:] = rows[slot]
            else:
                np.copyto(dst, rows[slot].view(dst.dtype).reshape(dst.shape))
            return
        import torch  # noqa: PLC0415 - optional, only once a tensor is seen

        dst.copy_(torch.from_numpy(rows[slot]).view(dst.dtype).view(dst.shape))

    def check_out(self, array: Any, what: str = "output") -> Any:
        """``check`` plus: numpy outputs must be writable."""
        array = self.check(array, what)
        if isinstance(array, np.ndarray) and not array.flags.writeable:
            raise BlockDtypeError(f"{what} is a read-only array")
        return array
