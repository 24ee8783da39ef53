"""The remote tier's writes: ``RemoteWrites``, the blocks on their way to the store.

With ``write="through"`` (the default) every block the host store commits is sent to the
store soon after (the writer task copies it out of its slot on the loop, where no eviction
can interleave, then ``SET``s a batch); with ``write="evict"`` only the blocks the host store
evicts are, copied out while the store core evicts them (``spill``) into a bounded queue
(past ``max_pending_bytes`` they are dropped and counted, never waited for). A block the
store already holds is not sent again.

Each value carries the block's canonical name (``shm.block_names``) in its header, which is
what lets every other replica announce the block. Write-through therefore waits for a
block's name when the engine's hook put it before the engine's event named it (``named``);
a block evicted from shared memory while it still waits is written then, unnamed (its bytes
are still shared: hooks find it by its key; it is only not announced).

What is written joins the tier's index (``shm.tiers.remote_tier``), which owns the connection:
the writes ask it for the client of the moment and hand it what the store took. A write
that fails is counted and logged, never retried: the block is a miss for later. Call
everything from the owner's event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import structlog

from shm.block_names import BlockName
from shm.tiers.remote_keys import BATCH_BYTES, RemoteKeys, pack_value

__all__ = ["RemoteWrites"]

log = structlog.get_logger(component="shm")

BlockKey = tuple[int, int]
# A queued write: key, name, and its value (None: read from its slot when sent).
_Write = tuple[BlockKey, BlockName | None, bytes | None]


class RemoteWrites:
    """The write queue of one remote tier; ``run()`` is its writer task."""

    def __init__(
        self,
        keys: RemoteKeys,
        value_bytes: int,
        *,
        write: str,
        max_pending_bytes: int,
        holds: Callable[[BlockKey], bool],
        client: Callable[[], Any],
        written: Callable[[list[tuple[BlockKey, BlockName | None]]], None],
    ) -> None:
        """``holds``: whether the store holds a block (the tier's index); ``client``: the
        store's client now (None while it is away); ``written``: what the store took."""
        self.keys = keys
        self.value_bytes = value_bytes
        self.write = write
        self.max_pending_bytes = max_pending_bytes
        self._holds, self._client, self._written = holds, client, written
        self._queue: deque[_Write] = deque()
        self._queued: set[BlockKey] = set()
        # Committed, to be written through once named: store hash → keys (one per shard).
        self._unnamed: dict[int, list[BlockKey]] = {}
        self._pending_bytes = 0  # of values copied into the queue
        self._sending = 0  # blocks of the batch being sent
        self._wake = asyncio.Event()
        self._rows: Any = None  # (num_slots, block_bytes) rows of the segment
        self._slots_of: Callable[[list[BlockKey]], list[int | None]] = lambda keys: []
        self.num_writes = self.num_write_bytes = self.num_errors = self.num_dropped = 0

    def attach(self, rows: Any, slots_of: Callable[[list[BlockKey]], list[int | None]]) -> None:
        """``rows``: the segment's block rows; ``slots_of``: where the host store holds keys
        (write-through copies its blocks out of their slots when it sends them)."""
        self._rows, self._slots_of = rows, slots_of

    def detach(self) -> None:
        """Let go of the segment, which is unmapped next, and of the store, which holds
        views of it: a block still waiting in its slot is dropped."""
        self._rows = None
        self._slots_of = lambda keys: [None] * len(keys)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_pending(self) -> int:
        """Blocks queued for writing, or being sent."""
        return len(self._queue) + self._sending

    @property
    def num_unnamed(self) -> int:
        """Blocks write-through holds back until they are named."""
        return sum(map(len, self._unnamed.values()))

    # -------------------------------------------------------------- what to write
    def committed(self, blocks: Sequence[tuple[BlockKey, int]],
                  names: Sequence[BlockName | None]) -> None:
        """The host store's commit hook (write-through): queue blocks the store lacks; an
        unnamed one waits for its name (``named``) or its eviction (``spill``)."""
        if self._client() is None:
            self.num_dropped += len(blocks)
            return
        queued, queue = self._queued, self._queue
        for (key, _), name in zip(blocks, names, strict=True):
            if self._holds(key) or key in queued:
                continue
            if name is None:
                self._unnamed.setdefault(key[1], []).append(key)
                continue
            queued.add(key)
            queue.append((key, name, None))
        self._wake.set()

    def named(self, came: dict[int, BlockName]) -> None:
        """Names came for blocks the store held unnamed: write through those that wait."""
        if not self._unnamed:
            return
        queued, queue = self._queued, self._queue
        for store_hash, name in came.items():
            for key in self._unnamed.pop(store_hash, ()):
                if not self._holds(key) and key not in queued:
                    queued.add(key)
                    queue.append((key, name, None))
        self._wake.set()

    def spill(self, blocks: Sequence[tuple[BlockKey, int]], names: Sequence[BlockName | None],
              rows: np.ndarray) -> None:
        """The host store's eviction hook (write on eviction, and write-through's blocks
        still waiting for a name): ``rows[slot]`` holds each block's bytes only until this
        returns, so they are copied into the queue."""
        if self.write != "evict":
            blocks, names = self._unnamed_of(blocks, names)
        if not blocks:
            return
        if self._client() is None:
            self.num_dropped += len(blocks)
            return
        for (key, slot), name in zip(blocks, names, strict=True):
            if self._holds(key) or key in self._queued:
                continue
            if self._pending_bytes + self.value_bytes > self.max_pending_bytes:
                self.num_dropped += 1
                continue
            self._queued.add(key)
            self._queue.append((key, name, pack_value(key, name, rows[slot])))
            self._pending_bytes += self.value_bytes
        self._wake.set()

    def _unnamed_of(self, blocks: Sequence[tuple[BlockKey, int]],
                    names: Sequence[BlockName | None],
                    ) -> tuple[list[tuple[BlockKey, int]], list[BlockName | None]]:
        """The evicted blocks write-through still holds back for a name (no longer)."""
        if not self._unnamed:
            return [], []
        out: list[tuple[BlockKey, int]] = []
        out_names: list[BlockName | None] = []
        for block, name in zip(blocks, names, strict=True):
            if self.forget_unnamed(block[0]):
                out.append(block)
                out_names.append(name)
        return out, out_names

    def forget_unnamed(self, key: BlockKey) -> bool:
        """Stop holding ``key`` back for its name: whether it was held back."""
        waiting = self._unnamed.get(key[1])
        if waiting is None or key not in waiting:
            return False
        waiting.remove(key)
        if not waiting:
            del self._unnamed[key[1]]
        return True

    # ------------------------------------------------------------------- sending
    async def run(self) -> None:
        """The writer task: send what is queued whenever something is."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        """Send everything queued, in batches."""
        per_batch = max(1, BATCH_BYTES // self.value_bytes)
        while self._queue:
            n = min(per_batch, len(self._queue))
            batch = [self._queue.popleft() for _ in range(n)]
            await self._send(batch)

    async def _send(self, batch: list[_Write]) -> None:
        """``SET`` a batch; what it wrote joins the tier's index (announced) at once."""
        for key, _, value in batch:
            self._queued.discard(key)
            if value is not None:
                self._pending_bytes -= self.value_bytes
        # Values still in their slots are copied out here, with no await in between.
        slots = self._slots_of([key for key, _, value in batch if value is None])
        rows, it = self._rows, iter(slots)
        ready: list[tuple[BlockKey, BlockName | None, bytes]] = []
        for key, name, queued in batch:
            value = queued
            if value is None:
                slot = next(it)
                if slot is None:  # evicted before it could be sent
                    self.num_dropped += 1
                    continue
                value = pack_value(key, name, rows[slot])
            ready.append((key, name, value))
        client = self._client()
        if not ready:
            return
        if client is None:
            self.num_dropped += len(ready)
            return
        pipe = client.pipeline(transaction=False)
        for key, _, value in ready:
            pipe.set(self.keys.name(key), value)
        self._sending = len(ready)
        try:
            await pipe.execute()
        except Exception as exc:
            self.num_errors += 1
            self.num_dropped += len(ready)
            log.warning("remote_tier_write_failed", blocks=len(ready),
                        error=f"{type(exc).__name__}: {exc}")
            return
        finally:
            self._sending = 0
        if self._client() is not client:  # it went away meanwhile: the index was cleared
            return
        self.num_writes += len(ready)
        self.num_write_bytes += len(ready) * self.value_bytes
        self._written([(key, name) for key, name, _ in ready])
