"""The prefix index as its own arrays (``IndexImage``): what is loaded is what was packed,
and an image that does not hold together is refused, leaving the index as it was."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kvcore.wire import WireError
from routing.placement.index_image import IndexImage, TableImage, WorkerImage
from routing.placement.prefix_index import PrefixIndex


def history(seed: int, workers: int, steps: int) -> tuple[list[KVEvent], list[list[int]]]:
    """Stores sharing prefixes, removals (orphans included), clears, across tiers."""
    rng = random.Random(seed)
    chains: list[list[int]] = []
    events: list[KVEvent] = []
    seqs: dict[str, int] = {}
    for _ in range(steps):
        worker = f"w{rng.randrange(workers)}"
        seq = seqs[worker] = seqs.get(worker, 0) + 1
        tier = rng.choice([Tier.GPU, Tier.GPU, Tier.HOST, Tier.DISK])
        roll = rng.random()
        if chains and roll < 0.15:
            chain = rng.choice(chains)
            events.append(BlockRemoved(worker, 1, seq, tier, rng.sample(chain, min(2, len(chain)))))
        elif roll < 0.17:
            events.append(AllBlocksCleared(worker, 1, seq, tier))
        else:
            base = rng.choice(chains)[: rng.randrange(0, 6)] if chains else []
            chain = base + [rng.getrandbits(64) for _ in range(rng.randrange(1, 8))]
            chains.append(chain)
            events.append(BlockStored(worker, 1, seq, tier, chain, None))
    return events, chains


def built(events: list[KVEvent]) -> PrefixIndex:
    index = PrefixIndex()
    for event in events:
        index.apply(event)
    return index


def roundtrip(index: PrefixIndex) -> PrefixIndex:
    raw = msgspec.msgpack.encode(index.to_image())
    loaded = PrefixIndex()
    loaded.load_image(msgspec.msgpack.decode(raw, type=IndexImage))
    return loaded


class TestRoundTrip:
    @settings(max_examples=40, deadline=None)
    @given(seed=st.integers(0, 2**32), workers=st.sampled_from([1, 3, 9, 20, 40]))
    def test_loaded_index_answers_and_evolves_as_the_original(
        self, seed: int, workers: int
    ) -> None:
        """Same snapshot, same matches per tier, same orphans; and the same after more events
        (new workers past the old width included: 9, 20 and 40 workers widen the tables)."""
        events, chains = history(seed, workers, 120)
        split = len(events) * 2 // 3
        original = built(events[:split])
        loaded = roundtrip(original)
        for index in (original, loaded):
            for event in events[split:]:
                index.apply(event)
            index.apply(BlockStored("late", 1, 1, Tier.GPU, [7, 8, 9], None))
        assert loaded.snapshot() == original.snapshot()
        assert loaded.orphan_blocks() == original.orphan_blocks()
        for chain in chains:
            assert loaded.match_tiers(chain) == original.match_tiers(chain)

    def test_positions_and_resync_flags_survive(self) -> None:
        """A worker's (epoch, seq) and its pending resync are in the image."""
        index = PrefixIndex()
        index.apply(BlockStored("a", 5, 1, Tier.GPU, [1, 2], None))
        index.apply(BlockStored("b", 6, 1, Tier.GPU, [1, 3], None))
        index.apply(BlockStored("b", 6, 3, Tier.GPU, [4], 3))  # a gap: b needs a resync
        index.remove_worker("a")  # a free slot
        loaded = roundtrip(index)
        assert loaded.position("b") == (6, 3) and loaded.needs_resync("b")
        assert loaded.position("a") is None
        loaded.apply(BlockStored("c", 1, 1, Tier.GPU, [1], None))  # takes the free slot
        assert loaded.match([1, 3, 4]) == {"b": 3, "c": 1}


def test_a_copy_is_independent() -> None:
    """A copy answers as the original did, and neither sees the other's later events."""
    events, chains = history(5, 6, 80)
    original = built(events)
    copy = original.copy()
    assert copy.snapshot() == original.snapshot()
    copy.apply(BlockStored("new", 1, 1, Tier.GPU, chains[0], None))
    original.apply(AllBlocksCleared("w0", 1, 999, Tier.GPU))
    assert "new" not in original.worker_ids
    assert copy.match_tiers(chains[0])[Tier.GPU]["new"] == len(chains[0])
    assert roundtrip(copy).snapshot() == copy.snapshot()


def image_of(index: PrefixIndex) -> IndexImage:
    return index.to_image()


class TestRefused:
    @pytest.fixture
    def image(self) -> IndexImage:
        events, _ = history(3, 4, 60)
        return image_of(built(events))

    @pytest.mark.parametrize("damage", [
        lambda img: msgspec.structs.replace(img, version=9),
        lambda img: msgspec.structs.replace(img, width=24),
        lambda img: msgspec.structs.replace(img, tables=img.tables[:2]),
        lambda img: msgspec.structs.replace(
            img, workers=[*img.workers, msgspec.structs.replace(img.workers[0], worker_id="x")]),
        lambda img: msgspec.structs.replace(
            img, workers=[msgspec.structs.replace(img.workers[0], blocks=[1])]),
        lambda img: msgspec.structs.replace(img, workers=img.workers[1:]),  # stray holder bits
        lambda img: msgspec.structs.replace(img, tables=[
            msgspec.structs.replace(t, keys=t.keys[:-3]) for t in img.tables]),
        lambda img: msgspec.structs.replace(img, tables=[
            msgspec.structs.replace(t, keys=t.keys[:8] * (len(t.keys) // 8)) for t in img.tables]),
        lambda img: msgspec.structs.replace(img, tables=[
            TableImage(t.keys, t.parents, t.bits, [(12345, [(0, 5)])]) for t in img.tables]),
    ], ids=["version", "width", "tables", "worker-twice", "tiers", "stray-bits", "columns",
            "repeated-hash", "branch-point"])
    def test_damaged_image_is_refused_and_the_index_kept(self, image: IndexImage,
                                                         damage: object) -> None:
        """WireError, and the index answers as before."""
        index = PrefixIndex()
        index.apply(BlockStored("keep", 1, 1, Tier.GPU, [1, 2, 3], None))
        with pytest.raises(WireError):
            index.load_image(damage(image))  # type: ignore[operator]
        assert index.match([1, 2, 3]) == {"keep": 3}
        assert index.worker_ids == ["keep"]


def test_worker_image_fields() -> None:
    """A worker's counts are per tier, in tier order."""
    index = PrefixIndex()
    index.apply(BlockStored("w", 1, 1, Tier.HOST, [1, 2], None))
    (worker,) = index.to_image().workers
    assert worker == WorkerImage("w", 0, 1, 1, False, [0, 2, 0, 0], [0, 0, 0, 0])
