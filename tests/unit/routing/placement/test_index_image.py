"""The prefix index as its own arrays (``IndexImage``): what is loaded is what was packed,
and an image that does not hold together is refused, leaving the index as it was."""

from __future__ import annotations

import random
from collections.abc import Callable

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kvcore.wire import WireError
from routing.placement.index_image import IndexImage, TierImage, WorkerImage
from routing.placement.prefix_index import PrefixIndex
from routing.replicas.snapshots import decode_snapshot


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
        (new workers included, past 32 slots with 40 workers)."""
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


def retier(worker: WorkerImage, damage: Callable[[TierImage], TierImage]) -> WorkerImage:
    """The worker with ``damage`` done to each of its non-empty tiers."""
    return msgspec.structs.replace(
        worker, tiers=[damage(t) if t.keys else t for t in worker.tiers])


class TestRefused:
    @pytest.fixture
    def image(self) -> IndexImage:
        events, _ = history(3, 4, 60)
        return image_of(built(events))

    @pytest.mark.parametrize("damage", [
        lambda img: msgspec.structs.replace(img, version=1),
        lambda img: msgspec.structs.replace(
            img, workers=[*img.workers, msgspec.structs.replace(img.workers[0], worker_id="x")]),
        lambda img: msgspec.structs.replace(
            img, workers=[*img.workers, msgspec.structs.replace(img.workers[0], slot=99)]),
        lambda img: msgspec.structs.replace(
            img, workers=[msgspec.structs.replace(img.workers[0], tiers=img.workers[0].tiers[:1])]),
        lambda img: msgspec.structs.replace(img, workers=[
            retier(w, lambda t: TierImage(t.keys[:-3], t.parents, t.lost)) for w in img.workers]),
        lambda img: msgspec.structs.replace(img, workers=[
            retier(w, lambda t: TierImage(t.keys, t.parents[:-4], t.lost)) for w in img.workers]),
        lambda img: msgspec.structs.replace(img, workers=[
            retier(w, lambda t: TierImage(t.keys[:8] * (len(t.keys) // 8), t.parents, t.lost))
            for w in img.workers]),
        lambda img: msgspec.structs.replace(img, workers=[
            retier(w, lambda t: TierImage(t.keys, b"\xff" * len(t.parents), t.lost))
            for w in img.workers]),
    ], ids=["version", "worker-twice", "slot-twice", "tiers", "keys", "parents",
            "repeated-hash", "parent-out-of-range"])
    def test_damaged_image_is_refused_and_the_index_kept(self, image: IndexImage,
                                                         damage: object) -> None:
        """WireError, and the index answers as before."""
        index = PrefixIndex()
        index.apply(BlockStored("keep", 1, 1, Tier.GPU, [1, 2, 3], None))
        with pytest.raises(WireError):
            index.load_image(damage(image))  # type: ignore[operator]
        assert index.match([1, 2, 3]) == {"keep": 3}
        assert index.worker_ids == ["keep"]


def le(width: int, *values: int) -> bytes:
    return b"".join(v.to_bytes(width, "little") for v in values)


def test_worker_image_fields() -> None:
    """A worker's blocks are per tier, in tier order; parents are positions (a root points
    at itself, a parent it does not hold past the end, into ``lost``)."""
    index = PrefixIndex()
    index.apply(BlockStored("w", 1, 1, Tier.HOST, [1, 2], None))
    index.apply(BlockStored("w", 1, 2, Tier.HOST, [5], 4))
    (worker,) = index.to_image().workers
    empty = TierImage(b"", b"", b"")
    host = TierImage(le(8, 1, 2, 5), le(4, 0, 0, 3), le(8, 4))
    assert worker == WorkerImage("w", 0, 1, 2, False, [empty, host, empty, empty])
    assert roundtrip(index).snapshot() == index.snapshot()
    assert roundtrip(index).orphan_blocks() == 1


def test_a_snapshot_of_the_old_layout_is_refused() -> None:
    """A version 1 image (one packed table per tier) is refused with ``WireError``, in its
    own envelope or in the current one: the durable reader logs it and cold-starts."""
    old_image: tuple[object, ...] = (1, 8, [], [(b"", b"", b"", [])] * 4)
    for head in (b"\x01", b"\x02"):
        with pytest.raises(WireError):
            decode_snapshot(head + msgspec.msgpack.encode(("m", 16, 42, old_image)))
