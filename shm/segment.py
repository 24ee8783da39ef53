"""POSIX shared-memory segments: naming, the versioned header, create/attach, stale clean-up.

One segment holds one block store's memory, laid out as::

    [0, 4096)                 header (``_HEADER``), written once by the owner, last
    [4096, index_offset)      generation table: one little-endian u64 per slot
    [index_offset, data_off)  read index (``shm.read_index``): per-slot keys and seqlock,
                              key buckets, reader marks
    [data_offset, size)       ``num_slots`` slots of ``slot_bytes`` each (512-byte aligned)

The owner is the only writer of the header and the generation table. Clients write the read
index's keys and seqs only of the slots reserved to them, when they publish them (see
``shm.read_index``), and their read times and their own counter cells. The header is
written *after* the memory is allocated and pre-faulted, and carries a CRC-32, so a segment
left half-made by a crash never validates.

Names are ``/kvsidecar-<owner_id>-<purpose>-<uuid8>``. The owner holds an exclusive
``flock`` on its segment's descriptor for its whole life: the kernel drops it when the
owner dies, however it dies, so a restarted owner tells a live owner's segment (lock
held: conflict) from a dead one's (lock free: stale, unlink it) without trusting pids.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import mmap
import os
import re
import struct
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import posix_ipc  # type: ignore[import-not-found]  # ships no type stubs
import structlog

from shm.errors import ForeignSegmentError, HeaderCorruptError, OwnerConflictError
from shm.read_index import ReadIndex, ReadIndexLayout

__all__ = [
    "HEADER_VERSION",
    "SEGMENT_PREFIX",
    "Segment",
    "SegmentHeader",
    "SegmentPurpose",
    "segment_name",
    "segments_of",
    "unlink_stale_segments",
]

log = structlog.get_logger(component="shm")

SEGMENT_PREFIX = "kvsidecar-"
SHM_DIR = Path("/dev/shm")
MAGIC = b"KVSHMSEG"
HEADER_VERSION = 4  # 2: the read index; 3: its publication counters; 4: standby words
HEADER_BYTES = 4096
SLOT_ALIGN_BYTES = 512
PAGE_BYTES = 4096
# magic, version, header bytes, reserved, block bytes, slot bytes, slots, generation table
# offset, data offset, dtype, layout, owner id, owner pid, created (ns), then the CRC-32.
_HEADER = struct.Struct("<8sHHIQQQQQ16s16s64sQQ")
_CRC = struct.Struct("<I")
_OWNER_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_NAME_RE = re.compile(r"kvsidecar-(?P<owner>[A-Za-z0-9_.-]+)-(?P<purpose>[a-z]+)-[0-9a-f]{8}")


class SegmentPurpose(enum.Enum):
    """What a segment holds; part of its name."""

    DATA = "data"


def _align_up(value: int, align: int) -> int:
    return -(-value // align) * align


def check_owner_id(owner_id: str) -> str:
    """``owner_id`` if it can be part of a segment name, else ``ValueError``."""
    if not _OWNER_ID_RE.fullmatch(owner_id):
        raise ValueError(
            f"owner id {owner_id!r} must be 1-64 characters of letters, digits, '_', '.', '-'"
        )
    return owner_id


def segment_name(owner_id: str, purpose: SegmentPurpose) -> str:
    """A fresh segment name ``/kvsidecar-<owner_id>-<purpose>-<uuid8>``."""
    return f"/{SEGMENT_PREFIX}{check_owner_id(owner_id)}-{purpose.value}-{uuid.uuid4().hex[:8]}"


def segments_of(owner_id: str) -> list[str]:
    """Names (with the leading ``/``) of every segment in /dev/shm named for ``owner_id``.

    The owner id is matched exactly: owner ``a``'s segments are not ``a-b``'s.
    """
    found = []
    with contextlib.suppress(FileNotFoundError):
        for entry in SHM_DIR.iterdir():
            match = _NAME_RE.fullmatch(entry.name)
            if match and match["owner"] == owner_id:
                found.append("/" + entry.name)
    return sorted(found)


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """The segment's self-description; ``pack``/``unpack`` are its only (de)serializers."""

    block_bytes: int
    num_slots: int
    dtype: str
    layout: str
    owner_id: str
    owner_pid: int
    created_ns: int
    version: int = HEADER_VERSION

    @property
    def slot_bytes(self) -> int:
        return _align_up(self.block_bytes, SLOT_ALIGN_BYTES)

    @property
    def generation_offset(self) -> int:
        return HEADER_BYTES

    @property
    def index_offset(self) -> int:
        return HEADER_BYTES + 8 * self.num_slots

    @property
    def data_offset(self) -> int:
        index_bytes = ReadIndexLayout(self.num_slots).nbytes
        return _align_up(self.index_offset + index_bytes, PAGE_BYTES)

    @property
    def segment_bytes(self) -> int:
        return self.data_offset + self.num_slots * self.slot_bytes

    def pack(self) -> bytes:
        body = _HEADER.pack(
            MAGIC,
            self.version,
            HEADER_BYTES,
            0,
            self.block_bytes,
            self.slot_bytes,
            self.num_slots,
            self.generation_offset,
            self.data_offset,
            self.dtype.encode(),
            self.layout.encode(),
            self.owner_id.encode(),
            self.owner_pid,
            self.created_ns,
        )
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def unpack(cls, raw: bytes | memoryview, name: str, size: int) -> SegmentHeader:
        """Parse and check a header read from segment ``name`` of ``size`` bytes."""
        end = _HEADER.size + _CRC.size
        if size < HEADER_BYTES or len(raw) < end:
            raise HeaderCorruptError(f"segment {name} is {size} bytes, too small for a header")
        body = bytes(raw[: _HEADER.size])
        fields = _HEADER.unpack(body)
        (magic, version, header_bytes, _, block_bytes, slot_bytes, num_slots) = fields[:7]
        if magic != MAGIC:
            raise HeaderCorruptError(f"segment {name} has magic {magic!r}, expected {MAGIC!r}")
        if version != HEADER_VERSION:
            raise HeaderCorruptError(
                f"segment {name} has header version {version}, this build reads {HEADER_VERSION}"
            )
        (crc,) = _CRC.unpack(bytes(raw[_HEADER.size : end]))
        if crc != zlib.crc32(body):
            raise HeaderCorruptError(f"segment {name} header fails its checksum")
        try:
            header = cls(
                block_bytes=block_bytes,
                num_slots=num_slots,
                dtype=fields[9].rstrip(b"\0").decode(),
                layout=fields[10].rstrip(b"\0").decode(),
                owner_id=fields[11].rstrip(b"\0").decode(),
                owner_pid=fields[12],
                created_ns=fields[13],
                version=version,
            )
        except UnicodeDecodeError as exc:
            raise HeaderCorruptError(f"segment {name} header holds invalid text") from exc
        consistent = (
            header_bytes == HEADER_BYTES
            and block_bytes > 0
            and slot_bytes == header.slot_bytes
            and fields[7] == header.generation_offset
            and fields[8] == header.data_offset
            and header.segment_bytes <= size
        )
        if not consistent:
            raise HeaderCorruptError(
                f"segment {name} header sizes are inconsistent: {num_slots} slots of "
                f"{slot_bytes} bytes in {size} bytes"
            )
        return header


class Segment:
    """One mapped segment. The creating owner unlinks it; attachers only ``close()``.

    ``slots`` is a ``(num_slots, slot_bytes)`` uint8 view, ``generations`` a u64 view of
    the generation table and ``index`` the read index over its region; all die with the
    segment, so never keep them past ``close()``.
    """

    def __init__(
        self, name: str, shm: posix_ipc.SharedMemory, mm: mmap.mmap, header: SegmentHeader,
        *, owner: bool,
    ) -> None:
        self.name = name
        self.header = header
        self.is_owner = owner
        self._shm = shm
        self._mm: mmap.mmap | None = mm
        whole = np.frombuffer(mm, dtype=np.uint8)
        self.generations: np.ndarray = whole[
            header.generation_offset : header.generation_offset + 8 * header.num_slots
        ].view("<u8")
        self.slots: np.ndarray = whole[header.data_offset : header.segment_bytes].reshape(
            header.num_slots, header.slot_bytes
        )
        self.index = ReadIndex(whole[header.index_offset : header.data_offset],
                               header.num_slots, owner=owner)
        self._unlinked = False

    @classmethod
    def create(
        cls,
        owner_id: str,
        *,
        block_bytes: int,
        num_slots: int,
        dtype: str,
        layout: str,
        purpose: SegmentPurpose = SegmentPurpose.DATA,
    ) -> Segment:
        """Create, allocate, pre-fault and lock a new segment; write its header last."""
        if block_bytes < 1 or num_slots < 1:
            raise ValueError(f"need block_bytes >= 1 and num_slots >= 1, got {block_bytes}, "
                             f"{num_slots}")
        header = SegmentHeader(
            block_bytes=block_bytes,
            num_slots=num_slots,
            dtype=dtype,
            layout=layout,
            owner_id=check_owner_id(owner_id),
            owner_pid=os.getpid(),
            created_ns=time.time_ns(),
        )
        name = segment_name(owner_id, purpose)
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
        try:
            fcntl.flock(shm.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(shm.fd, 0o600)  # shm_open's mode is filtered by the umask
            size = header.segment_bytes
            os.ftruncate(shm.fd, size)
            try:
                os.posix_fallocate(shm.fd, 0, size)  # real pages now, ENOSPC now
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"cannot allocate {size} bytes in /dev/shm for {name} "
                    f"({os.strerror(exc.errno or errno.ENOSPC)}); is /dev/shm large enough "
                    "(docker: shm_size)?",
                ) from exc
            mm = mmap.mmap(shm.fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            packed = header.pack()
            mm[: len(packed)] = packed
        except BaseException:
            shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise
        log.info("shm_segment_created", segment=name, size_bytes=size, num_slots=num_slots,
                 block_bytes=block_bytes)
        return cls(name, shm, mm, header, owner=True)

    @classmethod
    def attach(cls, name: str, expected_owner_id: str | None = None) -> Segment:
        """Map an existing segment read-write after checking its header and owner."""
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError as exc:
            raise FileNotFoundError(errno.ENOENT, f"no shared-memory segment {name}") from exc
        try:
            size = os.fstat(shm.fd).st_size
            if size < HEADER_BYTES:
                raise HeaderCorruptError(f"segment {name} is {size} bytes, too small for a header")
            mm = mmap.mmap(shm.fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            shm.close_fd()
        try:
            header = SegmentHeader.unpack(mm[:HEADER_BYTES], name, size)
        except BaseException:
            mm.close()
            raise
        if expected_owner_id is not None and header.owner_id != expected_owner_id:
            mm.close()
            raise ForeignSegmentError(
                f"segment {name} belongs to owner {header.owner_id!r}, "
                f"expected {expected_owner_id!r}"
            )
        log.debug("shm_segment_attached", segment=name, size_bytes=size)
        return cls(name, shm, mm, header, owner=False)

    def close(self) -> None:
        """Unmap (idempotent). Views handed out from ``slots`` must be gone by now."""
        if self._mm is None:
            return
        del self.slots, self.generations, self.index
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:
            # A caller still holds a view; the mapping then lives until that view dies.
            log.warning("shm_segment_unmap_deferred", segment=self.name, reason="views alive")
        if self.is_owner:
            self._shm.close_fd()  # drops the owner lock

    def unlink(self) -> None:
        """Remove the name from /dev/shm (owner only, idempotent)."""
        if not self.is_owner:
            raise PermissionError(f"only the owner unlinks segment {self.name}")
        if self._unlinked:
            return
        self._unlinked = True
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.name)
        log.info("shm_segment_unlinked", segment=self.name)

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.is_owner:
            self.unlink()


def unlink_stale_segments(owner_id: str) -> list[str]:
    """Unlink every segment of ``owner_id`` whose owner is dead; return their names.

    Raises ``OwnerConflictError`` if a live owner still holds one of them.
    """
    removed = []
    for name in segments_of(check_owner_id(owner_id)):
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            continue  # gone meanwhile
        try:
            try:
                fcntl.flock(shm.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise OwnerConflictError(
                    f"segment {name} is held by a live owner with id {owner_id!r}; "
                    "owner ids must be unique per host"
                ) from exc
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(name)
        finally:
            shm.close_fd()
        log.info("shm_segment_unlinked", segment=name, reason="stale")
        removed.append(name)
    return removed
