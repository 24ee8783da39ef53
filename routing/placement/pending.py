"""Speculative indexing: a just-routed prefix counts as cached on its worker for a while.

Between a routing decision and the engine's stored event there is a window (the prefill, plus
event latency) in which the index does not yet know the worker will hold the prefix. Without
speculation, back-to-back identical prompts scatter over the workers. Each placement records
its blocks here for ``ttl_s``; the stored event that confirms them, or the TTL, removes them.
The router takes, per worker, the larger of the real and the pending overlap.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvcore.events import BlockRemoved, BlockStored, Tier
from routing.placement.prefix_index import PrefixIndex

__all__ = ["PendingPrefixes"]


class PendingPrefixes:
    """Recently routed prefixes per worker, expiring after ``ttl_s``."""

    def __init__(self, ttl_s: float = 2.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._index = PrefixIndex()
        self._expiry: dict[str, dict[int, float]] = {}  # worker → block → latest expiry
        self._queue: deque[tuple[float, str, Sequence[int]]] = deque()  # in expiry order
        self._seq: dict[str, int] = {}

    def record(self, worker_id: str, block_hashes: Sequence[int], now: float) -> None:
        """The request with these blocks was just routed to ``worker_id``."""
        if not block_hashes:
            return
        self.expire(now)
        expiry = now + self.ttl_s
        held = self._expiry.setdefault(worker_id, {})
        run: list[int] = []  # a contiguous run of blocks not yet pending on this worker
        run_parent: int | None = None
        for i, block in enumerate(block_hashes):
            if block in held:
                if run:
                    self._emit(BlockStored, worker_id, run, run_parent)
                    run = []
            else:
                if not run:
                    run_parent = block_hashes[i - 1] if i else None
                run.append(block)
            held[block] = expiry
        if run:
            self._emit(BlockStored, worker_id, run, run_parent)
        self._queue.append((expiry, worker_id, block_hashes))

    def confirm(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        """The worker reported these blocks stored: they need no speculation any more."""
        held = self._expiry.get(worker_id)
        if not held:
            return
        gone = [b for b in block_hashes if held.pop(b, None) is not None]
        if gone:
            self._emit(BlockRemoved, worker_id, gone)

    def expire(self, now: float) -> None:
        """Drop entries whose TTL has passed."""
        queue = self._queue
        while queue and queue[0][0] <= now:
            _, worker_id, block_hashes = queue.popleft()
            held = self._expiry.get(worker_id)
            if not held:
                continue
            gone = [b for b in block_hashes if held.get(b, now + 1) <= now]
            for block in gone:
                del held[block]
            if gone:
                self._emit(BlockRemoved, worker_id, gone)

    def match(self, block_hashes: Sequence[int], now: float) -> dict[str, int]:
        """Leading blocks of the request speculatively held per worker."""
        self.expire(now)
        return self._index.match(block_hashes)

    def forget_worker(self, worker_id: str) -> None:
        self._expiry.pop(worker_id, None)
        self._seq.pop(worker_id, None)
        self._index.remove_worker(worker_id)

    def _emit(
        self,
        kind: type[BlockStored] | type[BlockRemoved],
        worker_id: str,
        blocks: list[int],
        parent: int | None = None,
    ) -> None:
        seq = self._seq.get(worker_id, 0) + 1
        self._seq[worker_id] = seq
        if kind is BlockStored:
            self._index.apply(BlockStored(worker_id, 0, seq, Tier.GPU, blocks, parent))
        else:
            self._index.apply(BlockRemoved(worker_id, 0, seq, Tier.GPU, blocks))
