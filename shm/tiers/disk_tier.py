"""The disk tier: blocks evicted from the host store, kept in a local directory.

One file per block (``shm.tiers.disk_format``), written to ``<name>.tmp`` and renamed into place,
its checksum verified on every read (``shm.tiers.disk_files``: what the tier does to files), so a
crash (or a torn page after a power loss) never makes a torn block readable: a file that
fails its check is dropped, counted, and the read is a miss.

The owner's event loop never waits for the disk on the write path: ``spill`` (called by
the store core while it evicts, before the evicted slots get new holders) copies each
block into a pre-faulted staging buffer and queues it; one writer thread writes the queued
blocks in batches and hands the finished ones back to the loop, where they join the tier's
index and are announced (``BlockStored``, tier ``disk``, one per chain of parent → child
blocks, as the host tier's: ``shm.host_events``). Each block keeps its canonical name
(``shm.block_names``), given when it is spilled and written in its file's header: the
tier's events name blocks by it, and a block without one is kept but never announced.
When the staging buffers are all in use (the disk falls behind), further evicted blocks
are dropped and counted, never waited for. Reads (a get that missed in shared memory)
``preadv`` each file straight into the slot the block is promoted to, and check it, in a
worker thread (``read_many``).

The tier has a byte capacity and its own LRU (a read makes a block recent); what it evicts
is unlinked by the writer thread and announced (``BlockRemoved``, tier ``disk``). At start
it scans its directory (torn ``.tmp`` files are removed; block files are re-indexed in
modification order), so it survives a restart and re-announces what it holds. A lock file
keeps two owners off one directory.

Call everything from the owner's event loop; only the writer thread and ``read_many``'s file
reads (which touch no shared state) run elsewhere.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog

from kvcore.events import KVEvent, Tier
from shm.block_names import BlockName
from shm.host_events import HostEventLog
from shm.tiers.disk_files import BlockFiles

__all__ = ["DiskTier", "DiskTierStats"]

log = structlog.get_logger(component="shm")

BlockKey = tuple[int, int]
_STAGING_BYTES = 64 << 20  # staging buffers for blocks on their way to disk
_MIN_STAGING_BLOCKS = 4


# What the writer thread does: ("write" | "unlink", key, staging row, the block's name).
_Job = tuple[str, BlockKey, int, BlockName | None]


@dataclass(frozen=True, slots=True)
class DiskTierStats:
    num_blocks: int
    num_bytes: int
    capacity_bytes: int
    num_writes: int  # blocks written
    num_write_bytes: int
    num_reads: int  # blocks read back (promoted to shared memory), from disk or staging
    num_read_bytes: int
    num_evictions: int  # blocks the tier's LRU dropped
    num_corrupt: int  # blocks dropped because their file failed its check
    num_errors: int  # I/O errors (each a miss or a block not kept, and a log line)
    num_dropped: int  # evicted blocks not kept: the staging buffers were all in use
    num_pending: int  # blocks staged, not written yet


class DiskTier:
    """A directory of block files with a byte capacity; ``await start()`` before use."""

    def __init__(self, directory: Path, capacity_bytes: int, block_bytes: int, *,
                 worker_id: str, staging_blocks: int | None = None) -> None:
        self.files = BlockFiles(directory, block_bytes)
        self.directory = self.files.directory
        self.block_bytes = block_bytes
        self.file_bytes = self.files.file_bytes
        if capacity_bytes < self.file_bytes:
            raise ValueError(f"a disk tier of {capacity_bytes} bytes holds no block file of "
                             f"{self.file_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self.worker_id = worker_id
        # Never more than the tier holds, nor than _STAGING_BYTES (unless blocks are huge).
        self._staging_blocks = staging_blocks or max(_MIN_STAGING_BLOCKS, min(
            _STAGING_BYTES // block_bytes, capacity_bytes // self.file_bytes))
        # On disk, by last use: key → the block's name (None: unnamed, never announced).
        self._index: OrderedDict[BlockKey, BlockName | None] = OrderedDict()
        # Staged for writing: key → (staging row, name).
        self._pending: dict[BlockKey, tuple[int, BlockName | None]] = {}
        self._cancelled: set[BlockKey] = set()  # staged, then removed: unlink once written
        self._reading: dict[BlockKey, int] = {}  # files being read: the LRU passes them over
        self._staging = np.empty((0, block_bytes), np.uint8)
        self._free_rows: list[int] = []
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._notify: Callable[[], None] = lambda: None
        self._lock_fd: int | None = None
        self._log = HostEventLog(worker_id, Tier.DISK)
        self.num_writes = self.num_write_bytes = self.num_reads = self.num_read_bytes = 0
        self.num_evictions = self.num_corrupt = self.num_errors = self.num_dropped = 0

    # ---------------------------------------------------------------- lifecycle
    async def start(self, notify: Callable[[], None]) -> None:
        """Lock and scan the directory, pre-fault the staging buffers, start the writer.
        ``notify``: called on the loop when events are waiting (``take_events``)."""
        self._loop = asyncio.get_running_loop()
        self._notify = notify
        await asyncio.to_thread(self._open)
        try:
            recovered, errors = await asyncio.to_thread(self.files.scan)
        except BaseException:
            self._unlock()
            raise
        self.num_errors += errors
        for key, _, name in recovered:
            self._index[key] = name
        self._enforce_capacity()
        # In written order, so a chain's blocks mostly stay one event.
        self._announce(list(self._index.values()))
        self._free_rows = list(range(self._staging_blocks - 1, -1, -1))
        self._writer = threading.Thread(target=self._write_loop, name="disk-tier-writer",
                                        daemon=True)
        self._writer.start()
        log.info("disk_tier_started", directory=str(self.directory), blocks=len(self._index),
                 capacity_bytes=self.capacity_bytes, staging_blocks=self._staging_blocks)

    def _open(self) -> None:
        self._lock_fd = self.files.lock()
        # Fresh memory is costly to touch on the eviction path: fault it in now.
        staging = np.empty((self._staging_blocks, self.block_bytes), np.uint8)
        staging.fill(0)
        self._staging = staging

    async def aclose(self) -> None:
        """Write what is staged, stop the writer, unlock; what is on disk stays."""
        writer, self._writer = self._writer, None
        if writer is not None:
            self._jobs.put(None)
            await asyncio.to_thread(writer.join)
            # What the last batch's report queued (unlinks: capacity, removals) after it.
            await asyncio.to_thread(self._finish_unlinks)
        self._unlock()

    def _finish_unlinks(self) -> None:
        while not self._jobs.empty():
            job = self._jobs.get_nowait()
            if job is not None and job[0] == "unlink":
                self.files.unlink(job[1])

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -------------------------------------------------------------------- writes
    def spill(self, blocks: Sequence[tuple[BlockKey, int]], names: Sequence[BlockName | None],
              rows: np.ndarray) -> None:
        """Keep blocks the host store evicts, with their names: ``rows[slot]`` holds each
        one's bytes now (the caller hands the slots to new holders after this returns).
        Copies and queues them; a block already on disk, or staged, is only made recent."""
        if self._writer is None:
            return
        index, pending, free = self._index, self._pending, self._free_rows
        for (key, slot), name in zip(blocks, names, strict=True):
            if key in index:
                index.move_to_end(key)
                continue
            if key in pending:
                self._cancelled.discard(key)
                continue
            if not free:
                self.num_dropped += 1
                continue
            row = free.pop()
            self._staging[row] = rows[slot]
            pending[key] = row, name
            self._jobs.put(("write", key, row, name))
        if not free and self.num_dropped and self.num_dropped % 1024 == 1:
            log.warning("disk_tier_behind", dropped=self.num_dropped)

    def _write_loop(self) -> None:
        """The writer thread: take every queued job, do them, report the batch."""
        jobs = self._jobs
        while True:
            batch = [jobs.get()]
            while not jobs.empty():
                batch.append(jobs.get_nowait())
            stop = None in batch
            done: list[tuple[BlockKey, bool]] = []
            for job in batch:
                if job is None:
                    continue
                kind, key, row, name = job
                if kind == "write":
                    done.append((key, self.files.write(key, name, memoryview(self._staging[row]))))
                else:
                    self.files.unlink(key)
            if done:
                self._report(done)
            if stop:
                return

    def _report(self, done: list[tuple[BlockKey, bool]]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._written, done)
        except RuntimeError:  # the loop closed meanwhile: the files are there anyway
            pass

    def _written(self, done: list[tuple[BlockKey, bool]]) -> None:
        """On the loop: index what the writer finished, announce it, keep the capacity."""
        stored: list[BlockName | None] = []
        for key, ok in done:
            row, name = self._pending.pop(key)
            self._free_rows.append(row)
            if not ok:
                self.num_errors += 1
                continue
            if key in self._cancelled:
                self._cancelled.discard(key)
                self._jobs.put(("unlink", key, -1, None))
                continue
            self._index[key] = name
            self.num_writes += 1
            self.num_write_bytes += self.file_bytes
            stored.append(name)
        self._announce(stored)
        self._enforce_capacity()
        self._notify()

    def _announce(self, names: list[BlockName | None]) -> None:
        named = [n for n in names if n is not None]
        self._log.stored([n.block_hash for n in named], [n.parent_hash for n in named],
                         [None] * len(named))

    def _announce_removed(self, names: list[BlockName | None]) -> None:
        self._log.removed([n.block_hash for n in names if n is not None])

    def _enforce_capacity(self) -> None:
        limit = self.capacity_bytes // self.file_bytes
        over = len(self._index) - limit
        if over <= 0:
            return
        gone: list[BlockKey] = []
        for key in self._index:  # least recently used first, passing over those being read
            if key not in self._reading:
                gone.append(key)
                if len(gone) == over:
                    break
        if not gone:
            return
        over = len(gone)
        names = [self._index.pop(key) for key in gone]
        for key in gone:
            self._jobs.put(("unlink", key, -1, None))
        self.num_evictions += over
        self._announce_removed(names)

    # --------------------------------------------------------------------- reads
    def contains(self, key: BlockKey) -> bool:
        return key in self._index or (key in self._pending and key not in self._cancelled)

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Make blocks recent (a read of them is coming), so the LRU takes others first."""
        index = self._index
        for key in keys:
            if key in index:
                index.move_to_end(key)

    def read_into(self, key: BlockKey, dst: np.ndarray) -> bool:
        """Copy the block into ``dst`` (uint8, one block), here and now; ``False`` (a miss)
        if the tier lacks it or its file fails to read or to check (then it is dropped)."""
        source = self._source(key, dst)
        if isinstance(source, bool):
            return source
        return self._finish_read(key, source, self.files.read(key, source, dst))

    async def read_many(self, items: Sequence[tuple[BlockKey, np.ndarray]]) -> list[bool]:
        """``read_into`` for each ``(key, dst)``, the files read and checked in a worker
        thread, so the loop never waits on the disk."""
        out = [False] * len(items)
        todo: list[tuple[int, BlockKey, Path, np.ndarray]] = []
        for i, (key, dst) in enumerate(items):
            source = self._source(key, dst)
            if isinstance(source, bool):
                out[i] = source
            else:
                todo.append((i, key, source, dst))
        if not todo:
            return out
        reading = self._reading
        for _, key, _, _ in todo:
            reading[key] = reading.get(key, 0) + 1
        try:
            outcomes = await asyncio.to_thread(
                lambda: [self.files.read(key, path, dst) for _, key, path, dst in todo])
        finally:
            for _, key, _, _ in todo:
                left = reading.pop(key) - 1
                if left:
                    reading[key] = left
        for (i, key, path, _), outcome in zip(todo, outcomes, strict=True):
            out[i] = self._finish_read(key, path, outcome)
        self._enforce_capacity()  # what it passed over while they were read
        return out

    def _source(self, key: BlockKey, dst: np.ndarray) -> Path | bool:
        """Where a read of ``key`` comes from: its file, or (``True``) the staging buffer it
        waits in to be written (copied into ``dst`` now), or nowhere (``False``)."""
        staged = self._pending.get(key)
        if staged is not None and key not in self._cancelled:
            dst[:] = self._staging[staged[0]]  # still on its way to disk
            self.num_reads += 1
            self.num_read_bytes += self.block_bytes
            return True
        if key not in self._index:
            return False
        self._index.move_to_end(key)  # a read is a use
        return self.files.path(key)

    def _finish_read(self, key: BlockKey, path: Path, outcome: str | OSError | None) -> bool:
        """On the loop: count a read, or drop the block its failure shows unreadable."""
        held = key in self._index  # (the tier may have evicted it while it was read)
        if isinstance(outcome, OSError):
            self.num_errors += 1
            log.warning("disk_tier_read_failed", file=path.name, error=str(outcome))
            if held:
                self._drop(key, unlink=not isinstance(outcome, FileNotFoundError))
            return False
        if outcome is not None:
            self.num_corrupt += 1
            log.warning("disk_tier_block_corrupt", file=path.name, problem=outcome)
            if held:
                self._drop(key, unlink=True)
            return False
        self.num_reads += 1
        self.num_read_bytes += self.file_bytes
        return True

    def _drop(self, key: BlockKey, *, unlink: bool) -> None:
        name = self._index.pop(key)
        if unlink:
            self._jobs.put(("unlink", key, -1, None))
        self._announce_removed([name])

    # ------------------------------------------------------------ removal, events
    def remove(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Drop the keys from the tier; per key, whether it held it."""
        out: list[bool] = []
        gone: list[BlockName | None] = []
        for key in keys:
            if key in self._index:
                gone.append(self._index.pop(key))
                self._jobs.put(("unlink", key, -1, None))
                out.append(True)
            elif key in self._pending and key not in self._cancelled:
                self._cancelled.add(key)  # unlinked once written; never announced
                out.append(True)
            else:
                out.append(False)
        self._announce_removed(gone)
        return out

    def name_of(self, key: BlockKey) -> BlockName | None:
        """The name the tier keeps with a block it holds (None: unnamed, or not held)."""
        staged = self._pending.get(key)
        return staged[1] if staged is not None else self._index.get(key)

    def take_events(self) -> list[KVEvent]:
        return self._log.take()

    def stats(self) -> DiskTierStats:
        return DiskTierStats(
            num_blocks=len(self._index),
            num_bytes=len(self._index) * self.file_bytes,
            capacity_bytes=self.capacity_bytes,
            num_writes=self.num_writes,
            num_write_bytes=self.num_write_bytes,
            num_reads=self.num_reads,
            num_read_bytes=self.num_read_bytes,
            num_evictions=self.num_evictions,
            num_corrupt=self.num_corrupt,
            num_errors=self.num_errors,
            num_dropped=self.num_dropped,
            num_pending=len(self._pending),
        )
