"""The prefix index's per-worker tables: branch points, conflicts, wide fleets, churn."""

from __future__ import annotations

import random

from kvcore.events import BlockRemoved, BlockStored, Tier
from routing.placement.prefix_index import PrefixIndex


def fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


def expected_match(held: dict[str, set[int]], query: list[int]) -> dict[str, int]:
    out = {}
    for worker, blocks in held.items():
        depth = 0
        while depth < len(query) and query[depth] in blocks:
            depth += 1
        if depth:
            out[worker] = depth
    return out


class Feed:
    """Sequenced events for one index, with the held sets a brute-force match needs."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.seq: dict[str, int] = {}
        self.held: dict[str, set[int]] = {}

    def _next(self, worker: str) -> int:
        self.seq[worker] = self.seq.get(worker, 0) + 1
        return self.seq[worker]

    def store(self, worker: str, blocks: list[int], parent: int | None = None) -> None:
        self.index.apply(BlockStored(worker, 0, self._next(worker), Tier.GPU, blocks, parent))
        self.held.setdefault(worker, set()).update(blocks)

    def remove(self, worker: str, blocks: list[int]) -> None:
        self.index.apply(BlockRemoved(worker, 0, self._next(worker), Tier.GPU, blocks))
        self.held.setdefault(worker, set()).difference_update(blocks)


class TestBranchPoints:
    def test_parent_with_many_children_on_one_worker(self) -> None:
        """Removing a block with three held children orphans all three; storing it adopts them."""
        rng = random.Random(1)
        root = fresh(rng, 2)
        tails = [fresh(rng, 3) for _ in range(3)]
        feed = Feed(PrefixIndex())
        feed.store("a", root)
        for tail in tails:
            feed.store("a", tail, parent=root[1])
        feed.store("b", root + tails[0])
        feed.remove("a", [root[1]])
        assert feed.index.orphan_blocks() == 3
        for tail in tails:
            assert feed.index.match(root + tail) == expected_match(feed.held, root + tail)
        feed.store("a", [root[1]], parent=root[0])
        assert feed.index.orphan_blocks() == 0
        feed.remove("a", tails[1][::-1])
        feed.remove("a", [root[1]])  # two children left: both orphaned
        assert feed.index.orphan_blocks() == 2
        assert feed.index.match(root + tails[2]) == {"a": 1, "b": 2}

    def test_everything_removed_leaves_nothing(self) -> None:
        """After every worker drops every block, in any order, the index is empty again."""
        rng = random.Random(2)
        root = fresh(rng, 4)
        tails = [fresh(rng, 5) for _ in range(4)]
        feed = Feed(PrefixIndex())
        for worker in "abc":
            feed.store(worker, root)
            for tail in tails:
                feed.store(worker, tail, parent=root[-1])
        everything = root + [b for tail in tails for b in tail]
        for worker in "abc":
            order = list(everything)
            rng.shuffle(order)
            feed.remove(worker, order)
        assert feed.index.num_blocks() == 0
        assert feed.index.orphan_blocks() == 0
        assert feed.index.memory_bytes() < 2_000
        assert feed.index.match(root + tails[0]) == {}


class TestParentConflicts:
    def test_each_worker_keeps_its_parent_and_accounting_stays_whole(self) -> None:
        """A block reported under two parents keeps each worker's own: answers stay exact
        per worker, a root of one worker held below a root by another included, and the
        counts stay whole to the end."""
        rng = random.Random(3)
        p, q, x = fresh(rng, 3)
        feed = Feed(PrefixIndex())
        feed.store("a", [p, x])
        feed.store("b", [q])
        feed.store("b", [x], parent=q)
        assert feed.index.orphan_blocks() == 0  # b holds x's parent as b reported it
        assert feed.index.match([p, x]) == {"a": 2}
        assert feed.index.match([q, x]) == {"b": 2}
        assert feed.index.match([x]) == {"a": 1, "b": 1}  # no worker's root: asks each
        feed.store("c", [x])  # now x is c's root, and a and b hold it below theirs
        assert feed.index.match([x]) == {"a": 1, "b": 1, "c": 1}
        assert feed.index.match([x, q]) == {"a": 1, "b": 2, "c": 1}
        feed.remove("a", [p])
        assert feed.index.orphan_blocks() == 1  # a holds x, not its parent p
        assert feed.index.match([p, x]) == {}
        for query in ([x], [x, q], [q, x], [p, x]):
            assert feed.index.match(query) == expected_match(feed.held, query)
        for worker in "abc":
            feed.remove(worker, [x, q, p])
        assert feed.index.num_blocks() == feed.index.orphan_blocks() == 0
        assert feed.index.match_tiers([p, x]) == {}
        assert feed.index.match_tiers([x]) == {}


class TestWideFleet:
    def test_workers_past_every_width_match_brute_force(self) -> None:
        """Forty workers (masks past 32 bits) with orphans and snapshots stay exact."""
        rng = random.Random(4)
        base = fresh(rng, 40)
        feed = Feed(PrefixIndex())
        for i in range(40):
            worker = f"w{i}"
            feed.store(worker, base[: i + 1])
            if i % 3 == 0 and i > 2:
                feed.remove(worker, [base[i // 2]])  # a parent before its children
        feed.index.remove_worker("w7")
        feed.held.pop("w7")
        feed.store("late", base[:5])
        restored = PrefixIndex.from_bytes(feed.index.to_bytes())
        for n in (1, 2, 7, 20, 40):
            want = expected_match(feed.held, base[:n])
            assert feed.index.match(base[:n]) == want
            assert restored.match(base[:n]) == want
        assert restored.orphan_blocks() == feed.index.orphan_blocks() > 0
        assert restored.num_blocks() == feed.index.num_blocks() == sum(map(len, feed.held.values()))


class TestChurn:
    def test_table_stays_compact_and_exact_under_churn(self) -> None:
        """An LRU-like stream of stores and removals keeps answers exact and memory bounded."""
        rng = random.Random(5)
        feed = Feed(PrefixIndex())
        live: list[list[int]] = []
        for _ in range(3000):
            blocks = fresh(rng, rng.randint(1, 20))
            feed.store(rng.choice("ab"), blocks)
            live.append(blocks)
            if len(live) > 300:
                old = live.pop(0)
                for worker in "ab":
                    if old[0] in feed.held.get(worker, ()):
                        feed.remove(worker, old[::-1])
        for blocks in live[-50:]:
            assert feed.index.match(blocks) == expected_match(feed.held, blocks)
        assert feed.index.num_blocks() == sum(map(len, feed.held.values()))
        assert feed.index.memory_bytes() / feed.index.num_blocks() < 140  # ~165 unrebuilt
