"""Block shape checks and copies between caller arrays and slot views."""

from __future__ import annotations

import numpy as np
import pytest

from shm.client._blocks import BlockFormat
from shm.errors import BlockDtypeError, BlockSizeError

FMT = BlockFormat(block_bytes=64, dtype="float16")


class TestCheck:
    def test_accepts_store_dtype_and_raw_bytes(self) -> None:
        """Arrays of the store's dtype or of uint8, of exactly one block, are accepted."""
        FMT.check(np.zeros(32, np.float16))
        FMT.check(np.zeros((4, 8), np.float16))
        FMT.check(np.zeros(64, np.uint8))
        assert FMT.check(bytes(64)).dtype == np.uint8

    def test_wrong_size(self) -> None:
        """A block of the wrong byte size names both sizes."""
        with pytest.raises(BlockSizeError, match="is 62 bytes; this store's blocks are 64"):
            FMT.check(np.zeros(31, np.float16))

    def test_wrong_dtype(self) -> None:
        """A block of another dtype is refused even when its byte size fits."""
        with pytest.raises(BlockDtypeError, match="dtype float32; this store holds float16"):
            FMT.check(np.zeros(16, np.float32))

    def test_not_an_array(self) -> None:
        """Lists and other objects are refused with a message naming the type."""
        with pytest.raises(BlockDtypeError, match="is a list"):
            FMT.check([0] * 64)

    def test_read_only_output(self) -> None:
        """An output array must be writable."""
        out = np.zeros(32, np.float16)
        out.flags.writeable = False
        with pytest.raises(BlockDtypeError, match="read-only"):
            FMT.check_out(out)


class TestCopies:
    def test_numpy_round_trip_including_strided(self) -> None:
        """Contiguous and strided arrays copy in and out byte-exactly."""
        rows = np.zeros((2, 64), np.uint8)
        src = FMT.check(np.arange(32, dtype=np.float16).reshape(4, 8).T)  # not C-contiguous
        FMT.write(rows, 1, src)
        out = FMT.check_out(np.empty((8, 4), np.float16, order="F"))
        FMT.read(rows, 1, out)
        assert np.array_equal(out, src) and not rows[0].any()
        flat = np.empty(32, np.float16)
        FMT.read(rows, 1, flat)
        assert flat.tobytes() == np.ascontiguousarray(src).tobytes()

    def test_new_array_uses_store_dtype_or_bytes(self) -> None:
        """new_array gives the store's dtype, or uint8 when numpy lacks it (bfloat16)."""
        assert FMT.new_array().dtype == np.float16
        assert BlockFormat(64, "bfloat16").new_array().dtype == np.uint8

    def test_torch_tensors(self) -> None:
        """bfloat16 torch tensors copy in and out without going through numpy dtypes."""
        torch = pytest.importorskip("torch")
        fmt = BlockFormat(64, "bfloat16")
        src = torch.arange(32, dtype=torch.bfloat16).reshape(4, 8)
        fmt.check(src)
        rows = np.zeros((1, 64), np.uint8)
        fmt.write(rows, 0, src)
        out = torch.empty(32, dtype=torch.bfloat16)
        fmt.read(rows, 0, fmt.check_out(out))
        assert torch.equal(out.reshape(4, 8), src)
        with pytest.raises(BlockDtypeError, match="dtype float32"):
            fmt.check(torch.zeros(16, dtype=torch.float32))
