"""The host tier's event log: what the block store records for the router.

Every commit, eviction, removal and clear of the store becomes a normalized event with tier
``host`` (the canonical model of ``kvcore.events``), unstamped: the sidecar's relay numbers
it. The owner drains them after each request and hands them to its listener. A batch of
committed blocks that chain parent → child (one request's blocks, the common case) becomes
one ``BlockStored``.
"""

from __future__ import annotations

from kvcore.events import (
    UNSTAMPED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Tier,
)

__all__ = ["HostEventLog"]


def _uniform_tokens(token_lists: list[list[int] | None]) -> bool:
    """Whether blocks can share one event's flat ``token_ids``: all absent, or all one size."""
    if token_lists[0] is None:
        return token_lists.count(None) == len(token_lists)
    return None not in token_lists and len({len(t) for t in token_lists}) == 1  # type: ignore[arg-type]


class HostEventLog:
    """Events recorded since the last ``take``, in sequence order; ``tier``: the host tier,
    or the disk tier below it (``shm.tiers.disk_tier`` keeps its events the same way)."""

    def __init__(self, worker_id: str, tier: Tier = Tier.HOST) -> None:
        self.worker_id = worker_id
        self.tier = tier
        self._events: list[KVEvent] = []

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def removed(self, hashes: list[int]) -> None:
        if hashes:
            self._events.append(
                BlockRemoved(self.worker_id, UNSTAMPED, UNSTAMPED, self.tier, hashes))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared(self.worker_id, UNSTAMPED, UNSTAMPED, self.tier))

    def stored(
        self, hashes: list[int], parents: list[int | None], token_lists: list[list[int] | None]
    ) -> None:
        """One ``BlockStored`` per run of the committed blocks that chain parent → child."""
        if not hashes:
            return
        start = 0
        if parents[1:] != hashes[:-1] or not _uniform_tokens(token_lists):
            for i in range(1, len(hashes)):  # the slow path: find where chains break
                if parents[i] != hashes[i - 1] or not _uniform_tokens(token_lists[i - 1 : i + 1]):
                    self._run(hashes[start:i], parents[start], token_lists[start:i])
                    start = i
        self._run(hashes[start:], parents[start], token_lists[start:])

    def _run(
        self, hashes: list[int], parent_hash: int | None, token_lists: list[list[int] | None]
    ) -> None:
        run_tokens = None
        if token_lists[0] is not None:
            run_tokens = [t for block in token_lists for t in block]  # type: ignore[union-attr]
        self._events.append(BlockStored(
            self.worker_id, UNSTAMPED, UNSTAMPED, self.tier, hashes, parent_hash, run_tokens))
