"""The canonical names of the store's blocks (``shm.block_names``): the host tier's events
in canonical terms, whatever the engine's storage hook keys blocks by."""

from __future__ import annotations

from kvcore.events import UNSTAMPED, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from shm.block_names import BlockName, BlockNames

W = "w0"


def stored(hashes: list[int], parent: int | None = None, tier: Tier = Tier.HOST) -> BlockStored:
    return BlockStored(W, UNSTAMPED, UNSTAMPED, tier, hashes, parent)


def removed(hashes: list[int], tier: Tier = Tier.HOST) -> BlockRemoved:
    return BlockRemoved(W, UNSTAMPED, UNSTAMPED, tier, hashes)


def engine_keyed(**kw: int) -> BlockNames:
    return BlockNames(W, canonical_keys=False, **kw)


def test_canonical_keys_name_blocks_by_their_keys() -> None:
    """With canonical keys a block's name is its key and the parent its put gave; events pass."""
    names = BlockNames(W)
    events: list[KVEvent] = [stored([1, 2], 9), removed([1])]
    assert names.translate(events) is events
    assert names.name_of(2, 1) == BlockName(2, 1)
    assert names.names_of([5, 6], [None, 5]) == [BlockName(5, None), BlockName(6, 5)]
    names.learn([1], [100], None)  # nothing to learn
    assert names.name_of(1) == BlockName(1, None)


def test_a_block_named_before_its_put_is_announced_canonically() -> None:
    """The engine's chain first, the store's commit after: one canonical BlockStored."""
    names = engine_keyed()
    names.learn([11, 12, 13], [101, 102, 103], 100)
    out = names.translate([stored([11, 12, 13], 777)])
    assert out == [stored([101, 102, 103], 100)]
    assert names.translate([removed([12, 99])]) == [removed([102])]  # 99: never announced


def test_a_block_put_before_its_name_is_parked_until_it_comes() -> None:
    """Committed before the engine's event named it: held back, then announced; a listener
    hears the names that came, and the owner is told events wait."""
    names = engine_keyed()
    heard: list[dict[int, BlockName]] = []
    told: list[bool] = []
    names.listeners.append(heard.append)
    names.notify = lambda: told.append(True)
    assert names.translate([stored([11, 12], None)]) == []
    assert names.num_parked == 2 and names.name_of(11) is None
    names.learn([11, 12, 13], [101, 102, 103], None)  # 13 is not in the store
    assert heard == [{11: BlockName(101, None), 12: BlockName(102, 101)}] and told
    assert names.translate([]) == [stored([101, 102], None)]
    assert names.num_parked == 0 and names.num_late == 2
    assert names.names_of([12, 13, 14], [None] * 3) == [
        BlockName(102, 101), BlockName(103, 102), None]


def test_a_parked_block_that_leaves_is_never_announced() -> None:
    """A parked block removed before its name came leaves no event; nor does the name later."""
    names = engine_keyed()
    assert names.translate([stored([11, 12])]) == []
    assert names.translate([removed([11])]) == []
    names.learn([11, 12], [101, 102], None)
    assert names.take() == [stored([102], 101)]


def test_a_clear_forgets_what_was_held_and_parked_but_keeps_the_names() -> None:
    """``AllBlocksCleared`` passes; a block put again afterwards is named at once."""
    names = engine_keyed()
    names.learn([11], [101], None)
    assert names.translate([stored([11]), stored([12])]) == [stored([101])]
    cleared = AllBlocksCleared(W, UNSTAMPED, UNSTAMPED, Tier.HOST)
    assert names.translate([cleared]) == [cleared]
    assert names.num_parked == 0
    assert names.translate([stored([11])]) == [stored([101])]


def test_lower_tiers_events_pass_and_promoted_blocks_bring_their_names() -> None:
    """Disk and remote events are canonical already; a block promoted from them is named by
    the name its tier kept."""
    names = engine_keyed()
    disk = stored([201, 202], 200, Tier.DISK)
    assert names.translate([disk]) == [disk]
    names.learn_one(12, BlockName(202, 201))
    assert names.translate([stored([12])]) == [stored([202], 201)]


def test_learned_names_are_bounded_but_held_ones_are_kept() -> None:
    """Names learned ahead of their puts live in an LRU of ``capacity``; a held block's name
    stays while it is held, and is remembered as recent once it leaves."""
    names = engine_keyed(capacity=2)
    names.learn([1], [101], None)
    names.translate([stored([1])])
    names.learn([2, 3, 4], [102, 103, 104], None)
    assert names.names_of([1, 2, 3, 4], [None] * 4) == [
        BlockName(101, None), None, BlockName(103, 102), BlockName(104, 103)]
    assert names.translate([removed([1])]) == [removed([101])]
    assert names.name_of(1) == BlockName(101, None) and names.name_of(3) is None
