"""PromptHold: a new prompt waits, on a replica that does not own it, for the owner's placement."""

from __future__ import annotations

import asyncio
import random

import pytest

from routing.placement.kv_router import KvRouter
from routing.placement.peer_share import PeerShare
from routing.replicas.messages import FirstToken, Placed, ReplicaBatch
from routing.replicas.peers import RemotePeers
from routing.replicas.prompt_hold import LIMIT_WINDOWS, PromptHold
from routing.replicas.shared_load import SharedLoad

WORKERS = ["w0", "w1", "w2", "w3"]


class Request:
    """What the hold sees of a request: it records when it was let go."""

    def __init__(self) -> None:
        self.done = False
        self.released = asyncio.Event()

    def hold_released(self) -> None:
        self.released.set()


class WallClock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


class Replica:
    """One gateway replica's router, shares, peers and hold, beside one peer ("a" is rank 0
    of 2, "b" rank 1)."""

    def __init__(self, window_s: float = 10.0, replica_id: str = "a") -> None:
        load = SharedLoad(16)
        self.router = KvRouter(rng=random.Random(1), load=load)
        share = self.router.peer_share = PeerShare(replica_id)
        self.peer_id = "b" if replica_id == "a" else "a"
        share.set_peers([self.peer_id])
        self.peers = RemotePeers(self.router, load, timeout_s=3.0)
        self.wall = WallClock()
        self.hold = PromptHold(self.router, share, window_s, wall_clock=self.wall)
        self.seq = 0

    def peer_batch(self, *placed: tuple[str, list[int]], settled_after_s: float = 0.0) -> None:
        """A batch of the peer's, placing each (worker, prompt blocks), settled as of
        ``settled_after_s`` after now by this replica's wall clock."""
        self.seq += 1
        events: list[Placed | FirstToken] = [
            Placed(f"k{self.seq}-{i}", worker_id, hashes, 16 * len(hashes), 16 * len(hashes))
            for i, (worker_id, hashes) in enumerate(placed)]
        batch = ReplicaBatch(self.peer_id, self.seq, False, events,
                             self.wall.now + settled_after_s)
        self.peers.apply(batch)
        self.hold.heard(batch.replica_id, batch.settled_at)

    def peer_placed(self, worker_id: str, hashes: list[int]) -> None:
        self.peer_batch((worker_id, hashes))


def blocks(owner_rank: int, n: int = 8, salt: int = 1) -> list[int]:
    """A prompt whose first block makes replica ``owner_rank`` (of 2) its owner."""
    first = salt * 1000 * 2 + owner_rank
    return [first, *(salt * 1000 * 2 + 2 * i + 7 for i in range(1, n))]


async def test_the_owner_places_a_new_prompt_at_once() -> None:
    r = Replica()
    assert not r.hold.offer(Request(), blocks(owner_rank=0), WORKERS)
    assert len(r.hold) == 0 and r.hold.num_held == 0


async def test_held_until_the_owner_placement_is_heard_then_follows_it() -> None:
    r = Replica()
    prompt = blocks(owner_rank=1)
    req = Request()
    assert r.hold.offer(req, prompt, WORKERS)
    r.peer_placed("w2", [99, 98])  # another prompt: still held
    assert not req.released.is_set() and len(r.hold) == 1
    r.peer_placed("w3", [*prompt[:6], 555])  # the owner placed a session with this prompt
    assert req.released.is_set() and len(r.hold) == 0
    assert (r.hold.num_followed, r.hold.num_passed, r.hold.num_timed_out) == (1, 0, 0)
    placement = r.router.place(prompt, 16 * len(prompt), WORKERS)
    assert placement is not None and placement.worker_id == "w3"


async def test_placed_here_once_the_owner_is_heard_past_the_window_without_it() -> None:
    r = Replica(window_s=0.05)
    req = Request()
    assert r.hold.offer(req, blocks(owner_rank=1), WORKERS)
    r.peer_batch(settled_after_s=0.049)  # the owner, as of just inside the window: wait on
    assert not req.released.is_set()
    r.peer_batch(settled_after_s=0.05)  # as of the window's end, still without it
    assert req.released.is_set()
    assert (r.hold.num_followed, r.hold.num_passed, r.hold.num_timed_out) == (0, 1, 0)


async def test_an_owner_not_yet_settled_past_the_window_does_not_pass_it() -> None:
    """The owner's batches, however late they are sent, say it has not yet read (or is
    still tokenizing) requests from before the window's end: one may be the prompt's other
    session, so wait on, and follow its placement instead of placing a second copy here."""
    r = Replica(window_s=0.05)
    prompt = blocks(owner_rank=1)
    req = Request()
    assert r.hold.offer(req, prompt, WORKERS)
    r.peer_batch(settled_after_s=0.049)
    assert not req.released.is_set()
    r.peer_batch(("w1", prompt), settled_after_s=0.049)
    assert req.released.is_set()
    assert (r.hold.num_followed, r.hold.num_passed) == (1, 0)


async def test_at_the_window_end_the_owner_is_asked_to_settle() -> None:
    """Asked at the window's end, an idle owner answers with a batch settled past it at
    once; a busy one when it has read its queued requests: no fixed time decides."""
    r = Replica(window_s=0.002)
    asked = asyncio.Event()
    owners: list[str] = []
    r.hold.ask_owner = lambda replica_id: (owners.append(replica_id), asked.set())
    req = Request()
    assert r.hold.offer(req, blocks(owner_rank=1), WORKERS)
    await asyncio.wait_for(asked.wait(), 5)
    assert owners == ["b"] and not req.released.is_set()
    r.peer_batch(settled_after_s=0.002)  # its answer: settled as of the window's end
    assert req.released.is_set()
    assert (r.hold.num_passed, r.hold.num_timed_out) == (1, 0)


async def test_a_replica_is_settled_as_of_its_oldest_request_in_preparation() -> None:
    r = Replica()
    now = r.wall.now
    assert r.hold.settled_at(now + 1) == now + 1  # nothing prepared off the loop
    first = r.hold.preparing()
    r.wall.now += 0.5
    second = r.hold.preparing()
    assert r.hold.settled_at(now + 1) == now
    r.hold.prepared(first)
    assert r.hold.settled_at(now + 1) == now + 0.5
    r.hold.prepared(second)
    r.hold.prepared(second)  # told twice: no harm
    assert r.hold.settled_at(now + 1) == now + 1


async def test_only_the_owner_batches_pass_the_window() -> None:
    """With three replicas, a batch of the one that does not own the prompt says nothing."""
    r = Replica(window_s=0.05)
    assert r.router.peer_share is not None
    r.router.peer_share.set_peers(["b", "c"])  # a, b, c: ranks 0, 1, 2
    prompt = [3 * 1000 + 2, 7, 9]  # owner rank 2: "c"
    req = Request()
    assert r.hold.offer(req, prompt, WORKERS)
    r.peer_batch(settled_after_s=1.0)  # from "b"
    assert not req.released.is_set()
    r.hold.heard("c", r.wall.now + 1.0)
    assert req.released.is_set()


async def test_placed_here_at_the_limit_when_the_owner_sends_nothing() -> None:
    r = Replica(window_s=0.002)
    req = Request()
    assert r.hold.offer(req, blocks(owner_rank=1), WORKERS)
    assert r.hold.limit_s == pytest.approx(0.002 * LIMIT_WINDOWS)
    await asyncio.wait_for(req.released.wait(), 5)
    assert r.hold.num_timed_out == 1 and len(r.hold) == 0


async def test_a_prompt_the_cache_prefers_a_worker_for_is_not_held() -> None:
    r = Replica()
    prompt = blocks(owner_rank=1)
    r.peer_placed("w1", prompt[:3])  # predicted on w1: the prefix decides
    assert r.hold.owner_of(prompt, WORKERS) is None
    assert not r.hold.offer(Request(), prompt, WORKERS)


async def test_the_key_is_the_first_block_no_worker_holds() -> None:
    r = Replica()
    shared_head = [2000, 2002]  # a common template head, held everywhere
    for worker_id in WORKERS:
        r.peer_placed(worker_id, shared_head)
    assert r.hold.owner_of([*shared_head, 3001, 5], WORKERS) == 1
    assert r.hold.owner_of([*shared_head, 3000, 5], WORKERS) == 0
    assert r.hold.owner_of(shared_head, WORKERS) is None  # nothing new in it


async def test_an_abandoned_request_is_not_released() -> None:
    r = Replica(window_s=0.002)
    req, other = Request(), Request()
    assert r.hold.offer(req, blocks(owner_rank=1), WORKERS)
    assert r.hold.offer(other, blocks(owner_rank=1, salt=2), WORKERS)
    req.done = True
    await asyncio.wait_for(other.released.wait(), 5)
    assert not req.released.is_set()


async def test_alone_again_releases_every_held_prompt() -> None:
    r = Replica()
    req = Request()
    assert r.hold.offer(req, blocks(owner_rank=1), WORKERS)
    assert r.router.peer_share is not None
    r.router.peer_share.set_peers([])  # the peer is gone
    r.hold.heard()  # as the link calls it when the peers change
    assert req.released.is_set()


async def test_no_hold_when_turned_off_or_alone() -> None:
    assert not Replica(window_s=0).hold.offer(Request(), blocks(owner_rank=1), WORKERS)
    alone = Replica()
    assert alone.router.peer_share is not None
    alone.router.peer_share.set_peers([])
    assert not alone.hold.offer(Request(), blocks(owner_rank=1), WORKERS)
    with pytest.raises(ValueError, match=">= 0"):
        PromptHold(alone.router, alone.router.peer_share, -1)


async def test_both_replicas_agree_on_the_owner() -> None:
    a, b = Replica(replica_id="a"), Replica(replica_id="b")
    for salt in range(1, 20):
        for rank in (0, 1):
            prompt = blocks(owner_rank=rank, salt=salt)
            held_a = a.hold.offer(Request(), prompt, WORKERS)
            held_b = b.hold.offer(Request(), prompt, WORKERS)
            assert held_a != held_b  # exactly one of them waits for the other
    a.hold.release_all()
    b.hold.release_all()


async def test_a_head_shared_by_many_prompts_leaves_a_prompt_new() -> None:
    """A chat template's preamble held on some workers only (here 2 blocks of a 32-block
    prompt) is no reason to prefer one: the prompt is still new, and its key is the first
    block past that head."""
    r = Replica()
    head = [4000, 4002]
    r.peer_placed("w0", head)
    r.peer_placed("w1", head[:1])
    prompt = [*head, 5001, *range(6001, 6030)]
    assert len(prompt) == 32
    assert r.hold.owner_of(prompt, WORKERS) == 1
    assert r.hold.offer(Request(), prompt, WORKERS)
    r.hold.release_all()
    short = [*head, 5001, 7]  # 4 blocks: no head allowed, w0 holds half of it
    assert r.hold.owner_of(short, WORKERS) is None
