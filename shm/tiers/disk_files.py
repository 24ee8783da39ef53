"""The disk tier's directory: ``BlockFiles``, what the tier does to files.

The directory is locked (``flock`` of ``.lock``) so two owners never share it, and scanned
at start: block files of this block size whose header checks are found again, oldest first;
torn ``.tmp`` files and foreign block files are removed. A block file
(``shm.tiers.disk_format``) is written to ``<name>.tmp`` and renamed into place, so a crash never
leaves a torn block under its name; it is read back with one ``preadv`` straight into the
caller's buffer and checked (header and checksum) before the read counts.

These are plain operations on paths, holding no state that changes, so they are safe on any
thread: the tier's writer thread writes and unlinks, ``read_many``'s worker thread reads;
the index, the LRU and the staging buffers are the tier's (``shm.tiers.disk_tier``).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import numpy as np
import structlog

from shm.block_names import BlockName
from shm.errors import OwnerConflictError
from shm.tiers.disk_format import (
    HEADER_BYTES,
    SUFFIX,
    TMP_SUFFIX,
    block_file_name,
    header_for,
    header_name,
    parse_name,
    problem_of,
)

__all__ = ["BlockFiles"]

log = structlog.get_logger(component="shm")

BlockKey = tuple[int, int]
_LOCK = ".lock"


class BlockFiles:
    """The block files of one disk tier's directory."""

    def __init__(self, directory: Path, block_bytes: int) -> None:
        self.directory = Path(directory)
        self.block_bytes = block_bytes
        self.file_bytes = HEADER_BYTES + block_bytes

    def path(self, key: BlockKey) -> Path:
        return self.directory / block_file_name(key)

    def lock(self) -> int:
        """Create the directory if need be and lock it: the lock file's descriptor (closing
        it unlocks); ``OwnerConflictError`` when another owner holds it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OwnerConflictError(
                f"another block store owner uses the disk tier {self.directory}") from None
        return fd

    def scan(self) -> tuple[list[tuple[BlockKey, int, BlockName | None]], int]:
        """The block files in the directory (key, mtime, name), oldest first, torn and
        foreign files removed; and how many files failed to stat or remove (each logged)."""
        found: list[tuple[BlockKey, int, BlockName | None]] = []
        removed = errors = 0
        with os.scandir(self.directory) as entries:
            for entry in entries:
                name = entry.name
                if name == _LOCK:
                    continue
                key = parse_name(name) if name.endswith(SUFFIX) else None
                try:
                    st = entry.stat()
                    if key is not None and st.st_size == self.file_bytes:
                        ok, block_name = self._read_header(entry.path, key)
                        if ok:
                            found.append((key, st.st_mtime_ns, block_name))
                            continue
                    if name.endswith((SUFFIX, TMP_SUFFIX)):
                        os.unlink(entry.path)  # torn, or written for another block size
                        removed += 1
                except OSError as exc:
                    errors += 1
                    log.warning("disk_tier_scan_error", file=name, error=str(exc))
        if removed:
            log.info("disk_tier_files_removed", count=removed, reason="torn or foreign")
        found.sort(key=lambda item: item[1])
        return found, errors

    def _read_header(self, path: str, key: BlockKey) -> tuple[bool, BlockName | None]:
        """Whether a file's header is this tier's for ``key``, and the block's name."""
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
        return header_name(raw, key, self.block_bytes)

    def write(self, key: BlockKey, name: BlockName | None, payload: memoryview) -> bool:
        """Write a block's file, renamed into place once whole: whether it was (a failure
        is logged, its ``.tmp`` removed)."""
        header = header_for(key, name, self.block_bytes, payload)
        path = self.path(key)
        tmp = path.with_name(path.name + TMP_SUFFIX)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                written = os.writev(fd, [header, payload])
            finally:
                os.close(fd)
            if written != self.file_bytes:
                raise OSError(f"short write: {written} of {self.file_bytes} bytes")
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("disk_tier_write_failed", file=path.name, error=str(exc))
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return False
        return True

    def unlink(self, key: BlockKey) -> None:
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("disk_tier_unlink_failed", key=key, error=str(exc))

    def read(self, key: BlockKey, path: Path, dst: np.ndarray) -> str | OSError | None:
        """Read a block file into ``dst`` and check it: None, a problem, or the error."""
        header = bytearray(HEADER_BYTES)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                got = os.preadv(fd, [header, dst.data], 0)
            finally:
                os.close(fd)
        except OSError as exc:
            return exc
        if got != self.file_bytes:
            return f"{got} bytes, expected {self.file_bytes}"
        return problem_of(header, key, self.block_bytes, dst.data)
