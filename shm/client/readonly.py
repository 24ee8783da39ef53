"""A read-only mapping of another owner's segment: how a peer on the same host reads blocks.

A sidecar that imports blocks from a peer sidecar on the same host maps the peer's segment
with ``PROT_READ`` (opened ``O_RDONLY``, so even a bug cannot write to it) and copies the
peer's leased slots straight into its own store: no socket carries the payload. The header
is checked as ``Segment.attach`` checks it. The mapping stays valid after the peer dies or
unlinks the segment (the memory lives until the last mapping goes), so a reader must
confirm its lease with the peer after copying before trusting the bytes.
"""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np
import posix_ipc  # type: ignore[import-not-found]  # ships no type stubs
import structlog

from shm.errors import ForeignSegmentError, HeaderCorruptError
from shm.segment import HEADER_BYTES, SegmentHeader

__all__ = ["ReadOnlySegment"]

log = structlog.get_logger(component="shm")


class ReadOnlySegment:
    """``rows[slot]`` is slot ``slot``'s block (read-only uint8); ``generations`` likewise."""

    def __init__(self, name: str, mm: mmap.mmap, header: SegmentHeader) -> None:
        self.name = name
        self.header = header
        self._mm: mmap.mmap | None = mm
        whole = np.frombuffer(mm, dtype=np.uint8)
        self.generations: np.ndarray = whole[
            header.generation_offset : header.generation_offset + 8 * header.num_slots
        ].view("<u8")
        self.rows: np.ndarray = whole[header.data_offset : header.segment_bytes].reshape(
            header.num_slots, header.slot_bytes
        )[:, : header.block_bytes]

    @classmethod
    def attach(cls, name: str, expected_owner_id: str | None = None) -> ReadOnlySegment:
        """Map segment ``name`` read-only; ``FileNotFoundError`` if this host has none."""
        try:
            shm = posix_ipc.SharedMemory(name, read_only=True)
        except posix_ipc.ExistentialError as exc:
            raise FileNotFoundError(errno.ENOENT, f"no shared-memory segment {name}") from exc
        except posix_ipc.PermissionsError as exc:
            raise PermissionError(errno.EACCES, f"segment {name} is not readable by this "
                                  "user (segments are mode 0600)") from exc
        try:
            size = os.fstat(shm.fd).st_size
            if size < HEADER_BYTES:
                raise HeaderCorruptError(f"segment {name} is {size} bytes, too small for a header")
            mm = mmap.mmap(shm.fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                           prot=mmap.PROT_READ)
        finally:
            shm.close_fd()
        try:
            header = SegmentHeader.unpack(mm[:HEADER_BYTES], name, size)
            if expected_owner_id is not None and header.owner_id != expected_owner_id:
                raise ForeignSegmentError(
                    f"segment {name} belongs to owner {header.owner_id!r}, "
                    f"expected {expected_owner_id!r}"
                )
        except BaseException:
            mm.close()
            raise
        log.debug("shm_segment_attached", segment=name, size_bytes=size, read_only=True)
        return cls(name, mm, header)

    def check_generations(self, slots: list[int], generations: list[int]) -> list[int]:
        """The slots among ``slots`` whose generation is no longer the one given."""
        if not slots:
            return []
        current = self.generations[slots].tolist()
        return [s for s, g, c in zip(slots, generations, current, strict=True) if g != c]

    def close(self) -> None:
        """Unmap (idempotent); views taken from ``rows`` must be gone by now."""
        if self._mm is None:
            return
        del self.rows, self.generations
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:
            log.warning("shm_segment_unmap_deferred", segment=self.name, reason="views alive")

    def __enter__(self) -> ReadOnlySegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
