"""Replica sync's pure parts: the wire frames, the shared load, and folding a peer's batches."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcore import BlockHasher, Namespace
from kvcore.wire import WireError
from routing.placement.kv_router import KvRouter
from routing.replicas.messages import (
    AskedPrompt,
    Claimed,
    ClaimRequest,
    Finished,
    FirstToken,
    Placed,
    ReplicaBatch,
    ResyncRequest,
    decode_batch,
    decode_claim,
    decode_resync,
    encode,
)
from routing.replicas.peers import RemotePeers
from routing.replicas.shared_load import SharedLoad

HASHER = BlockHasher(16)
SEED = Namespace("m").seed
WORKERS = ["w0", "w1", "w2", "w3"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def prompt(n_blocks: int, salt: int) -> tuple[int, list[int]]:
    tokens = [salt * 7919 + i for i in range(16 * n_blocks)]
    return len(tokens), HASHER.hash_tokens(tokens, SEED)


class Replica:
    """One gateway's routing core with a shared load, and its view of the peers."""

    def __init__(self, name: str, clock: Clock, seed: int) -> None:
        self.name = name
        self.load = SharedLoad(16)
        self.router = KvRouter(rng=random.Random(seed), clock=clock, load=self.load)
        self.peers = RemotePeers(self.router, self.load, timeout_s=3.0, clock=clock)
        self.seq = 0

    def place(self, key: str, n_blocks: int, salt: int) -> str:
        tokens, hashes = prompt(n_blocks, salt)
        placement = self.router.place(hashes, tokens, WORKERS)
        assert placement is not None
        self.router.dispatch(key, placement, hashes, tokens)
        return placement.worker_id

    def publish(self, snapshot: bool = False) -> bytes:
        """This tick's batch, as the link would send it."""
        events = self.load.snapshot() if snapshot else self.load.outbox
        self.load.outbox = []
        self.seq += 1
        return encode(ReplicaBatch(self.name, self.seq, snapshot, events))

    def hear(self, frame: bytes) -> bool:
        return self.peers.apply(decode_batch(frame))


class TestWire:
    def test_round_trip(self) -> None:
        """A batch decodes to what was encoded, every event kind in order."""
        batch = ReplicaBatch("r1", 7, False, [Placed("k", "w0", [1, 2**64 - 1], 40, 8),
                                              FirstToken("k"), Finished("k"),
                                              Claimed("w1", [3, 4])])
        assert decode_batch(encode(batch)) == batch
        assert decode_resync(encode(ResyncRequest("r2"))) == ResyncRequest("r2")
        claim = ClaimRequest("r3", [AskedPrompt([5, 6], ["w0", "w1"], "w1")])
        assert decode_claim(encode(claim)) == claim

    def test_a_version_1_batch_is_refused(self) -> None:
        """A replica from before claims (wire version 1) is told apart, not misread."""
        frame = bytearray(encode(ReplicaBatch("r1", 1, False, [])))
        frame[0] = 1
        with pytest.raises(WireError, match="version 1"):
            decode_batch(bytes(frame))

    def test_compact(self) -> None:
        """A placement costs little more than its block hashes (no field names on the wire)."""
        hashes = [2**63 + i for i in range(100)]
        frame = encode(ReplicaBatch("a1b2c3d4e5f6", 1, False,
                                    [Placed("abcd1234-1/a", "replica-0", hashes, 1600, 1600)]))
        assert len(frame) < 9 * len(hashes) + 70  # + ids and counts

    def test_rejects_negative_counts(self) -> None:
        """Counts out of range are a WireError, not a negative load."""
        frame = encode(ReplicaBatch("r", 1, False, [Placed("k", "w", [1], -5, 0)]))
        try:
            decode_batch(frame)
        except WireError:
            return
        raise AssertionError("a negative prompt_tokens decoded")

    @given(st.binary(max_size=200))
    def test_arbitrary_bytes(self, raw: bytes) -> None:
        """Any bytes decode to a batch or raise WireError, never anything else."""
        for decode in (decode_batch, decode_resync):
            try:
                decode(raw)
            except WireError:
                pass


class TestSharedLoad:
    def test_local_lifecycle_is_queued(self) -> None:
        """add, first token and finish each queue one event, with the prefill credited."""
        load = SharedLoad(16)
        woken = []
        load.on_outbox = lambda: woken.append(1)
        load.add("k", "w0", [1, 2, 3], 48, cached_tokens=16)
        load.first_token("k")
        load.finish("k")
        assert load.outbox == [Placed("k", "w0", [1, 2, 3], 48, 32), FirstToken("k"),
                               Finished("k")]
        assert woken == [1]  # woken once: when the outbox stopped being empty

    def test_remote_requests_count_but_are_not_echoed(self) -> None:
        """A peer's request loads its worker here and is never published back."""
        load = SharedLoad(16)
        assert load.add_remote("@p/k", Placed("k", "w1", [1, 2], 32, 32))
        assert not load.add_remote("@p/k", Placed("k", "w1", [1, 2], 32, 32))
        assert load.load("w1").active_prefill_tokens == 32
        load.first_token_remote("@p/k")
        assert load.load("w1").active_prefill_tokens == 0
        load.finish_remote("@p/k")
        load.finish_remote("@p/k")  # twice: the second is a no-op
        assert load.in_flight() == 0 and load.outbox == [] and load.num_remote == 0

    def test_snapshot_lists_local_requests_only(self) -> None:
        """A snapshot is every local request in flight, as it stands now."""
        load = SharedLoad(16)
        load.add("a", "w0", [1], 16)
        load.add("b", "w1", [2], 32)
        load.first_token("b")
        load.add_remote("@p/c", Placed("c", "w2", [3], 16, 16))
        assert load.snapshot() == [Placed("a", "w0", [1], 16, 16), Placed("b", "w1", [2], 32, 0)]

    def test_forgotten_worker_ends_local_requests_for_peers(self) -> None:
        """A worker leaving ends its local requests, and the peers are told."""
        load = SharedLoad(16)
        load.add("a", "w0", [1], 16)
        load.add_remote("@p/c", Placed("c", "w0", [3], 16, 16))
        load.outbox = []
        assert load.forget_worker("w0") == ["a"]
        assert load.outbox == [Finished("a")] and load.num_remote == 0


class TestPeers:
    def test_peer_placement_draws_the_same_prefix(self) -> None:
        """A prefix placed through one replica goes to the same worker through the other."""
        clock = Clock()
        a, b = Replica("a", clock, 1), Replica("b", clock, 2)
        for salt in range(8):
            worker = a.place(f"a{salt}", 40, salt)
            b.hear(a.publish())
            assert b.place(f"b{salt}", 40, salt) == worker
            a.hear(b.publish())

    def test_peer_load_is_not_double_booked(self) -> None:
        """Distinct prompts through two replicas spread as through one gateway."""
        clock = Clock()
        a, b = Replica("a", clock, 1), Replica("b", clock, 2)
        chosen = []
        for i in range(4):
            replica = (a, b)[i % 2]
            chosen.append(replica.place(f"k{i}", 40, 100 + i))
            frame = replica.publish()
            (b, a)[i % 2].hear(frame)
        assert sorted(chosen) == WORKERS  # each worker once, as one gateway would

    def test_joins_and_losses_are_reported(self) -> None:
        """The live peers are reported when one is first heard and when one is dropped
        (the link hands them to the router's ``PeerShare``)."""
        clock = Clock()
        a, b = Replica("a", clock, 1), Replica("b", clock, 2)
        seen: list[list[str]] = []
        b.peers.on_change = seen.append
        b.hear(a.publish())
        b.hear(a.publish())
        assert seen == [["a"]]
        clock.now += 3.5
        b.peers.expire()
        assert seen == [["a"], []]

    def test_silent_peer_load_is_dropped(self) -> None:
        """A peer silent past the timeout leaves no load behind."""
        clock = Clock()
        a, b = Replica("a", clock, 1), Replica("b", clock, 2)
        worker = a.place("k", 40, 1)
        b.hear(a.publish())
        assert b.load.in_flight_on(worker) == 1
        clock.now += 2.0
        assert b.peers.expire() == []
        clock.now += 1.5
        assert b.peers.expire() == ["a"]
        assert b.load.in_flight_on(worker) == 0 and len(b.peers) == 0

    def test_own_stall_is_not_the_peers_silence(self) -> None:
        """A replica stalled past the timeout (paused) keeps its peers and their load; a peer
        still silent a timeout after the stall is dropped."""
        clock = Clock()
        a, b = Replica("a", clock, 1), Replica("b", clock, 2)
        worker = a.place("k", 40, 1)
        b.hear(a.publish())
        assert b.peers.expire() == []
        clock.now += 5.0  # b paused: a's heartbeats wait unread
        assert b.peers.expire() == []
        assert b.load.in_flight_on(worker) == 1 and b.peers.num_lost == 0
        for step in (1.0, 1.0, 0.9):
            clock.now += step
            assert b.peers.expire() == []
        clock.now += 0.2
        assert b.peers.expire() == ["a"]
        assert b.load.in_flight_on(worker) == 0

    def test_finish_releases_peer_load(self) -> None:
        """The peer's finish releases the load it placed here."""
        clock = Clock()
        a, b = Replica("a", clock, 1), Replica("b", clock, 2)
        worker = a.place("k", 40, 1)
        a.router.load.first_token("k")
        a.router.load.finish("k")
        b.hear(a.publish())
        assert b.load.in_flight_on(worker) == 0 and b.load.num_remote == 0

    def test_gap_asks_for_snapshot_which_replaces_the_view(self) -> None:
        """A missed batch asks once for a snapshot; the snapshot replaces the peer's load."""
        clock = Clock()
        a, b = Replica("a", clock, 1), Replica("b", clock, 2)
        a.place("k1", 10, 1)
        assert not b.hear(a.publish())
        a.router.load.finish("k1")
        a.place("k2", 10, 2)
        a.publish()  # lost: b never sees k1 finish
        a.place("k3", 10, 3)
        assert b.hear(a.publish())  # a gap: ask for a snapshot
        a.place("k4", 10, 4)
        assert not b.hear(a.publish())  # asked already
        assert b.load.num_remote == 3  # k1 (stale), k3, k4
        assert not b.hear(a.publish(snapshot=True))
        assert b.load.num_remote == 3  # k2, k3, k4: as a holds them
        assert b.peers.num_gaps == 1

    def test_late_joiner_asks_for_snapshot(self) -> None:
        """A replica first heard mid-stream is asked for its snapshot."""
        clock = Clock()
        a, b = Replica("a", clock, 1), Replica("b", clock, 2)
        a.place("k1", 10, 1)
        a.publish()
        assert b.hear(a.publish())
