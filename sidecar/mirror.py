"""A live mirror of what one worker holds, per tier, kept from its normalized events.

The relay needs it to hand a late subscriber a snapshot; it trusts its input to be in order
(the relay stamps the sequence numbers itself), so it is a plain block → parent map per tier.

It also keeps each block's token ids when its events carried them, so a snapshot lets a
subscriber hash the blocks in another scheme (the indexer API's XXH3 rolling hashes) as live
events do. Compactly: one ``bytes`` per block (little-endian u32, the wire's form), in a
second dict per tier holding only the blocks that have them.
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
from kvcore.wire import WireError, pack_le

__all__ = ["BlockMirror"]


class BlockMirror:
    """Blocks (with their parents and token ids) one worker holds in each tier."""

    def __init__(self) -> None:
        self._tiers: list[dict[int, int | None]] = [{} for _ in Tier]
        self._tokens: list[dict[int, bytes]] = [{} for _ in Tier]  # block → its u32 LE ids

    def apply(self, event: KVEvent) -> None:
        blocks = self._tiers[event.tier]
        if isinstance(event, BlockStored):
            parent = event.parent_hash
            for block in event.block_hashes:
                blocks.setdefault(block, parent)
                parent = block
            if event.token_ids:
                self._keep_tokens(self._tokens[event.tier], event)
        elif isinstance(event, BlockRemoved):
            tokens = self._tokens[event.tier]
            for block in event.block_hashes:
                blocks.pop(block, None)
                tokens.pop(block, None)
        elif isinstance(event, AllBlocksCleared):
            blocks.clear()
            self._tokens[event.tier].clear()

    def clear(self) -> None:
        for blocks in self._tiers:
            blocks.clear()
        for tokens in self._tokens:
            tokens.clear()

    def num_blocks(self, tier: Tier) -> int:
        return len(self._tiers[tier])

    def holds(self, tier: Tier, block_hash: int) -> bool:
        return block_hash in self._tiers[tier]

    def snapshot(self, worker_id: str, epoch: int, seq: int, *,
                 tokens: bool = True) -> WorkerSnapshot:
        """Every block held, with its token ids unless ``tokens`` is False (a subscriber
        that hashes in no other scheme: the tokens are most of its bytes)."""
        tiers = []
        for t, blocks in enumerate(self._tiers):
            if not blocks:
                continue
            ids = self._tokens[t] if tokens else None
            held = list(blocks)
            per_block = [ids.get(b, b"") for b in held] if ids else []
            tiers.append(TierBlocks(Tier(t), held, list(blocks.values()), per_block))
        return WorkerSnapshot(worker_id, epoch, seq, tiers)

    @staticmethod
    def _keep_tokens(tokens: dict[int, bytes], event: BlockStored) -> None:
        """Each block's share of the event's token ids, for the blocks that have none yet
        (a block is stored once; a repeat carries the same tokens)."""
        assert event.token_ids is not None
        hashes = event.block_hashes
        try:
            raw = pack_le(event.token_ids)
        except WireError:  # not u32 (the event type bounds them: never here)
            return
        step = len(raw) // len(hashes)
        for i, block in enumerate(hashes):
            if block not in tokens:
                tokens[block] = raw[i * step : (i + 1) * step]
