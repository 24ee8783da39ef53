"""A live mirror of what one worker holds, per tier, kept from its normalized events.

The relay needs it to hand a late subscriber a snapshot; it trusts its input to be in order
(the relay stamps the sequence numbers itself), so it is a plain block → parent map per tier.
"""

from __future__ import annotations

from kvcore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Tier,
    TierBlocks,
    WorkerSnapshot,
)

__all__ = ["BlockMirror"]


class BlockMirror:
    """Blocks (with their parents) one worker holds in each tier."""

    def __init__(self) -> None:
        self._tiers: list[dict[int, int | None]] = [{} for _ in Tier]

    def apply(self, event: KVEvent) -> None:
        blocks = self._tiers[event.tier]
        if isinstance(event, BlockStored):
            parent = event.parent_hash
            for block in event.block_hashes:
                blocks.setdefault(block, parent)
                parent = block
        elif isinstance(event, BlockRemoved):
            for block in event.block_hashes:
                blocks.pop(block, None)
        elif isinstance(event, AllBlocksCleared):
            blocks.clear()

    def clear(self) -> None:
        for blocks in self._tiers:
            blocks.clear()

    def num_blocks(self, tier: Tier) -> int:
        return len(self._tiers[tier])

    def holds(self, tier: Tier, block_hash: int) -> bool:
        return block_hash in self._tiers[tier]

    def snapshot(self, worker_id: str, epoch: int, seq: int) -> WorkerSnapshot:
        return WorkerSnapshot(
            worker_id,
            epoch,
            seq,
            [
                TierBlocks(Tier(t), list(blocks), list(blocks.values()))
                for t, blocks in enumerate(self._tiers)
                if blocks
            ],
        )
