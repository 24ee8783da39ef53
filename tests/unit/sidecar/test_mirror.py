"""The relay's mirror keeps each held block's token ids and serves them in its snapshots."""

from __future__ import annotations

from array import array

from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier, WorkerSnapshot
from kvcore.wire import decode, encode
from sidecar.mirror import BlockMirror

TOKENS = list(range(100, 112))  # 3 blocks of 4


def stored(blocks: list[int], parent: int | None, tokens: list[int] | None,
           tier: Tier = Tier.GPU) -> BlockStored:
    return BlockStored("w", 1, 1, tier, blocks, parent, tokens)


def per_block(snapshot: WorkerSnapshot, tier: Tier) -> dict[int, list[int]]:
    """Each block's token ids in ``snapshot`` (blocks without any left out)."""
    (blocks,) = [t for t in snapshot.tiers if t.tier == tier]
    out = {}
    for block, raw in zip(blocks.block_hashes, blocks.token_ids, strict=True):
        if raw:
            ids = array("I")
            ids.frombytes(raw)
            out[block] = ids.tolist()
    return out


def test_snapshot_carries_each_blocks_token_ids() -> None:
    """A chain stored in two events lists each block's own ids, in the block's order; they
    survive the wire as they are."""
    mirror = BlockMirror()
    mirror.apply(stored([1, 2], None, TOKENS[:8]))
    mirror.apply(stored([3], 2, TOKENS[8:]))
    snapshot = decode(encode(mirror.snapshot("w", 1, 2)))
    assert isinstance(snapshot, WorkerSnapshot)
    assert snapshot.tiers[0].block_hashes == [1, 2, 3]
    assert snapshot.tiers[0].parent_hashes == [None, 1, 2]
    assert per_block(snapshot, Tier.GPU) == {1: TOKENS[:4], 2: TOKENS[4:8], 3: TOKENS[8:]}
    assert snapshot.tiers[0].token_ids[0] == array("I", TOKENS[:4]).tobytes()


def test_blocks_without_tokens_and_tiers_apart() -> None:
    """A block stored without tokens is listed with none (b""), and gains them when stored
    again with them; a tier with no tokens at all lists none; tiers keep their own."""
    mirror = BlockMirror()
    mirror.apply(stored([1, 2], None, None))
    mirror.apply(stored([1], None, None, Tier.HOST))
    snapshot = mirror.snapshot("w", 1, 2)
    assert [t.token_ids for t in snapshot.tiers] == [[], []]
    mirror.apply(stored([2, 3], 1, TOKENS[4:]))  # block 2 again, now with its tokens
    snapshot = mirror.snapshot("w", 1, 3)
    assert snapshot.tiers[0].token_ids[0] == b""
    assert per_block(snapshot, Tier.GPU) == {2: TOKENS[4:8], 3: TOKENS[8:]}
    assert snapshot.tiers[1].token_ids == []


def test_removed_and_cleared_blocks_drop_their_tokens() -> None:
    """Removal and a cleared tier forget the tokens with the blocks; a block stored again
    takes the tokens of its new event."""
    mirror = BlockMirror()
    mirror.apply(stored([1, 2, 3], None, TOKENS))
    mirror.apply(stored([1], None, TOKENS[:4], Tier.HOST))
    mirror.apply(BlockRemoved("w", 1, 3, Tier.GPU, [2, 3]))
    assert per_block(mirror.snapshot("w", 1, 3), Tier.GPU) == {1: TOKENS[:4]}
    mirror.apply(stored([2], 1, [7, 7, 7, 7]))
    assert per_block(mirror.snapshot("w", 1, 4), Tier.GPU) == {1: TOKENS[:4], 2: [7] * 4}
    mirror.apply(AllBlocksCleared("w", 1, 5, Tier.GPU))
    snapshot = mirror.snapshot("w", 1, 5)
    assert [t.tier for t in snapshot.tiers] == [Tier.HOST]
    assert per_block(snapshot, Tier.HOST) == {1: TOKENS[:4]}
    mirror.clear()
    assert mirror.snapshot("w", 1, 6).tiers == []
    assert mirror._tokens == [{} for _ in Tier]  # nothing kept for blocks gone
