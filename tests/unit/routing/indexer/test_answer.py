"""The indexer API's answer from the prefix index: tokens per instance, medium and DP rank."""

from __future__ import annotations

from kvcore import BlockHasher, Namespace
from kvcore.events import BlockStored, Tier
from routing.indexer.answer import Rank, answer_query
from routing.placement.prefix_index import PrefixIndex
from routing.serve.indexer_routes import instance_of

HASHER = BlockHasher(4)
SEED = Namespace("m").seed
BLOCKS = HASHER.hash_tokens(list(range(4 * 6)), SEED)  # six blocks


def store(index: PrefixIndex, worker: str, seq: int, tier: Tier, first: int, last: int) -> None:
    parent = BLOCKS[first - 1] if first else None
    index.apply(BlockStored(worker, 1, seq, tier, BLOCKS[first:last], parent))


def test_tiers_ranks_and_longest_match() -> None:
    """GPU/CPU/DISK count each tier's leading blocks; DP and longest_matched count blocks held
    in any mix of tiers; an instance holding nothing answers zeros."""
    index = PrefixIndex()
    store(index, "a/dp0", 1, Tier.GPU, 0, 2)  # rank 0: blocks 0-1 on the GPU
    store(index, "a/dp0", 2, Tier.HOST, 2, 4)  # ... and 2-3 on the host, under block 1
    store(index, "a/dp1", 1, Tier.GPU, 0, 3)  # rank 1: blocks 0-2 on the GPU
    store(index, "a/dp1", 2, Tier.DISK, 0, 5)  # ... and 0-4 on disk
    instances = {"a": [Rank(0, "a/dp0"), Rank(1, "a/dp1")], "b": [Rank(0, "b")]}
    answer = answer_query(index, BLOCKS, 4, instances)
    assert answer["a"] == {"longest_matched": 20, "GPU": 12, "CPU": 0, "DISK": 20, "REMOTE": 0,
                           "DP": {"0": 16, "1": 20}}
    assert answer["b"] == {"longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0, "REMOTE": 0,
                           "DP": {"0": 0}}


def test_only_full_blocks_and_the_leading_run_count() -> None:
    """A prefix that diverges stops the count; an empty query matches nothing."""
    index = PrefixIndex()
    store(index, "w", 1, Tier.GPU, 0, 6)
    other = HASHER.hash_tokens([*range(8), 99, 99, 99, 99], SEED)  # block 2 differs
    assert answer_query(index, other, 4, {"w": [Rank(0, "w")]})["w"]["GPU"] == 8
    assert answer_query(index, [], 4, {"w": [Rank(0, "w")]})["w"]["longest_matched"] == 0


def test_instance_of_strips_only_its_own_rank_suffix() -> None:
    """A sidecar's '<base>/dp<rank>' worker is a rank of '<base>'; other ids are instances."""
    assert instance_of("replica-0/dp1", 1) == "replica-0"
    assert instance_of("replica-0/dp1", 0) == "replica-0/dp1"
    assert instance_of("replica-0", 0) == "replica-0"
    assert instance_of("http://h:1", None) == "http://h:1"
