"""The prefix index against a brute-force model, under any sequence of events."""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Tier,
    TierBlocks,
    WorkerSnapshot,
)
from routing.placement.prefix_index import ApplyOutcome, PrefixIndex

WORKERS = ["w0", "w1", "w2", "w3"]
TIERS = [Tier.GPU, Tier.HOST]
CHAIN_LEN = 12


def make_chains(seed: int) -> list[list[int]]:
    """A few chains of block hashes that share prefixes, like prompts sharing system prompts."""
    rng = random.Random(seed)
    fresh = lambda n: [rng.getrandbits(64) for _ in range(n)]  # noqa: E731
    base = fresh(CHAIN_LEN)
    return [
        base,
        base[:4] + fresh(CHAIN_LEN - 4),
        base[:8] + fresh(CHAIN_LEN - 8),
        fresh(CHAIN_LEN),
        base[:1] + fresh(CHAIN_LEN - 1),
    ]


class PrefixIndexMachine(RuleBasedStateMachine):
    """Random events vs a model: per (worker, tier) a set of held blocks."""

    @initialize(seed=st.integers(0, 2**32))
    def setup(self, seed: int) -> None:
        self.chains = make_chains(seed)
        self.parent_of: dict[int, int | None] = {}
        for chain in self.chains:
            for i, block in enumerate(chain):
                self.parent_of[block] = chain[i - 1] if i else None
        self.index = PrefixIndex()
        self.held: dict[tuple[str, Tier], set[int]] = {}
        self.position: dict[str, tuple[int, int]] = {}  # worker → (epoch, seq)
        self.resync: set[str] = set()
        self.history: list[KVEvent] = []

    # --- helpers ------------------------------------------------------------------------

    def next_position(self, worker: str) -> tuple[int, int]:
        epoch, seq = self.position.get(worker, (0, 0))
        return epoch, seq + 1

    def model_apply(self, event: KVEvent) -> None:
        key = (event.worker_id, event.tier)
        held = self.held.setdefault(key, set())
        if isinstance(event, BlockStored):
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held.difference_update(event.block_hashes)
        else:
            held.clear()

    def send(self, event: KVEvent, expect: ApplyOutcome) -> None:
        assert self.index.apply(event) is expect
        self.history.append(event)

    # --- rules --------------------------------------------------------------------------

    @rule(
        worker=st.sampled_from(WORKERS),
        tier=st.sampled_from(TIERS),
        chain=st.integers(0, 4),
        start=st.integers(0, CHAIN_LEN - 1),
        length=st.integers(1, CHAIN_LEN),
    )
    def store(self, worker: str, tier: Tier, chain: int, start: int, length: int) -> None:
        blocks = self.chains[chain][start : start + length]
        parent = self.chains[chain][start - 1] if start else None
        event = BlockStored(worker, *self.next_position(worker), tier, blocks, parent)
        self.send(event, ApplyOutcome.APPLIED)
        self.position[worker] = (event.epoch, event.seq)
        self.model_apply(event)

    @rule(worker=st.sampled_from(WORKERS), tier=st.sampled_from(TIERS), data=st.data())
    def remove(self, worker: str, tier: Tier, data: st.DataObject) -> None:
        universe = sorted(self.parent_of)
        blocks = data.draw(st.lists(st.sampled_from(universe), min_size=1, max_size=6))
        event = BlockRemoved(worker, *self.next_position(worker), tier, blocks)
        self.send(event, ApplyOutcome.APPLIED)
        self.position[worker] = (event.epoch, event.seq)
        self.model_apply(event)

    @rule(worker=st.sampled_from(WORKERS), tier=st.sampled_from(TIERS))
    def clear(self, worker: str, tier: Tier) -> None:
        event = AllBlocksCleared(worker, *self.next_position(worker), tier)
        self.send(event, ApplyOutcome.APPLIED)
        self.position[worker] = (event.epoch, event.seq)
        self.model_apply(event)

    @precondition(lambda self: bool(self.history))
    @rule(data=st.data())
    def replay_old_event(self, data: st.DataObject) -> None:
        """A duplicate or out-of-order event changes nothing."""
        event = data.draw(st.sampled_from(self.history))
        epoch, seq = self.position.get(event.worker_id, (0, 0))
        if event.epoch == epoch and event.seq <= seq:
            assert self.index.apply(event) is ApplyOutcome.DUPLICATE
        elif event.epoch < epoch:
            assert self.index.apply(event) is ApplyOutcome.STALE_EPOCH

    @rule(worker=st.sampled_from(WORKERS), tier=st.sampled_from(TIERS), chain=st.integers(0, 4))
    def store_after_gap(self, worker: str, tier: Tier, chain: int) -> None:
        """A skipped sequence number is applied but flags the worker for resync."""
        epoch, seq = self.next_position(worker)
        event = BlockStored(worker, epoch, seq + 1, tier, self.chains[chain][:3])
        self.send(event, ApplyOutcome.GAP)
        self.position[worker] = (epoch, seq + 1)
        self.resync.add(worker)
        self.model_apply(event)

    @rule(worker=st.sampled_from(WORKERS), chain=st.integers(0, 4))
    def engine_restart(self, worker: str, chain: int) -> None:
        """An event of a newer epoch clears the worker, then applies."""
        if worker not in self.position:
            return
        epoch = self.position[worker][0] + 1
        event = BlockStored(worker, epoch, 1, Tier.GPU, self.chains[chain][:5])
        self.send(event, ApplyOutcome.NEW_EPOCH)
        for tier in TIERS:
            self.held.pop((worker, tier), None)
        self.position[worker] = (epoch, 1)
        self.model_apply(event)

    @rule(worker=st.sampled_from(WORKERS))
    def remove_worker(self, worker: str) -> None:
        assert self.index.remove_worker(worker) is (worker in self.position)
        self.position.pop(worker, None)
        self.resync.discard(worker)
        for tier in TIERS:
            self.held.pop((worker, tier), None)

    @rule(worker=st.sampled_from(WORKERS))
    def resync_from_model(self, worker: str) -> None:
        """Loading a worker snapshot replaces its state and clears the resync flag."""
        if worker not in self.position:
            return
        epoch, seq = self.position[worker]
        tiers = []
        for tier in TIERS:
            blocks = sorted(self.held.get((worker, tier), ()))
            tiers.append(TierBlocks(tier, blocks, [self.parent_of[b] for b in blocks]))
        self.index.load_worker_snapshot(WorkerSnapshot(worker, epoch, seq, tiers))
        self.resync.discard(worker)

    @rule()
    def snapshot_round_trip(self) -> None:
        """An index restored from its bytes is the same index."""
        self.index = PrefixIndex.from_bytes(self.index.to_bytes())

    # --- invariants ---------------------------------------------------------------------

    @invariant()
    def matches_brute_force(self) -> None:
        if not hasattr(self, "index"):
            return
        for tier in TIERS:
            for chain in self.chains:
                for length in (1, 3, 4, 8, CHAIN_LEN):
                    query = chain[:length]
                    expected = {}
                    for worker in WORKERS:
                        held = self.held.get((worker, tier), set())
                        depth = 0
                        while depth < length and query[depth] in held:
                            depth += 1
                        if depth:
                            expected[worker] = depth
                    assert self.index.match(query, tier) == expected

    @invariant()
    def counts_agree(self) -> None:
        if not hasattr(self, "index"):
            return
        orphans = 0
        for (worker, tier), held in self.held.items():
            if worker in self.position:
                assert self.index.num_blocks(worker, tier) == len(held)
            orphans += sum(
                1 for b in held if self.parent_of[b] is not None and self.parent_of[b] not in held
            )
        assert self.index.orphan_blocks() == orphans
        for worker in WORKERS:
            assert self.index.needs_resync(worker) is (worker in self.resync)
            assert self.index.position(worker) == self.position.get(worker)


PrefixIndexMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestPrefixIndexModel = PrefixIndexMachine.TestCase
