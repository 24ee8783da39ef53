"""The event relay's core: stamping, mirroring, replay and snapshots."""

from __future__ import annotations

from kvcore.events import BlockRemoved, BlockStored, Tier, WorkerSnapshot
from kvcore.wire import decode
from routing.placement.prefix_index import PrefixIndex
from sidecar.relay import EventRelay


def relay(buffer_events: int = 8) -> EventRelay:
    return EventRelay("w0", block_size=16, model_id="m", buffer_events=buffer_events, epoch=5)


def stored(blocks: list[int], parent: int | None = None, tier: Tier = Tier.GPU) -> BlockStored:
    return BlockStored("engine-local-id", 99, 1234, tier, blocks, parent)


class TestRelay:
    def test_stamps_worker_epoch_and_sequence(self) -> None:
        """Published events carry the relay's worker id, epoch and consecutive sequence."""
        r = relay()
        frames = [r.publish(stored([1, 2])), r.publish(BlockRemoved("x", 0, 0, Tier.GPU, [2]))]
        events = [decode(f) for f in frames]
        assert [(e.worker_id, e.epoch, e.seq) for e in events] == [("w0", 5, 1), ("w0", 5, 2)]  # type: ignore[union-attr]

    def test_replay_when_buffered(self) -> None:
        """A subscriber within the buffer gets exactly the events it missed."""
        r = relay()
        for i in range(5):
            r.publish(stored([10 + i], parent=(9 + i) if i else None))
        plan = r.plan(epoch=5, seq=2)
        assert plan.start.mode == "replay" and plan.start.seq == 2
        assert [decode(f).seq for f in plan.backlog] == [3, 4, 5]  # type: ignore[union-attr]
        assert r.plan(epoch=5, seq=5).backlog == []

    def test_snapshot_when_out_of_buffer_or_new_epoch(self) -> None:
        """Too old a position, another epoch or none at all gets a snapshot of the mirror."""
        r = relay(buffer_events=3)
        for i in range(6):
            r.publish(stored([10 + i], parent=(9 + i) if i else None))
        r.publish(BlockRemoved("x", 0, 0, Tier.GPU, [15]))
        for epoch, seq in [(5, 1), (4, 7), (None, None), (5, 99)]:
            plan = r.plan(epoch, seq)
            assert plan.start.mode == "snapshot" and plan.start.seq == 7
            snapshot = decode(plan.backlog[0])
            assert isinstance(snapshot, WorkerSnapshot)
            assert sorted(snapshot.tiers[0].block_hashes) == [10, 11, 12, 13, 14]

    def test_snapshot_then_replay_rebuilds_the_same_index(self) -> None:
        """An index fed a snapshot plus later events equals one fed every event."""
        r = relay(buffer_events=100)
        whole = PrefixIndex()
        for i in range(10):
            whole.apply(decode(r.publish(stored([100 + i], parent=(99 + i) if i else None))))  # type: ignore[arg-type]
        late = PrefixIndex()
        late.load_worker_snapshot(decode(r.plan(None, None).backlog[0]))  # type: ignore[arg-type]
        for i in range(3):
            frame = r.publish(stored([200 + i], parent=(199 + i) if i else 109, tier=Tier.HOST))
            whole.apply(decode(frame))  # type: ignore[arg-type]
            late.apply(decode(frame))  # type: ignore[arg-type]
        query = [100 + i for i in range(10)]
        assert late.match_tiers(query) == whole.match_tiers(query)
        assert late.position("w0") == whole.position("w0") == (5, 13)
