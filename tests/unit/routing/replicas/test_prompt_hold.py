"""PromptHold: a new prompt waits, on a replica that does not own it, for the owner's placement."""

from __future__ import annotations

import asyncio
import random

import pytest

from routing.placement.kv_router import KvRouter
from routing.placement.peer_share import PeerShare
from routing.replicas.messages import (
    AskedPrompt,
    Claimed,
    ClaimRequest,
    FirstToken,
    Placed,
    ReplicaBatch,
    decode_batch,
    decode_claim,
    encode,
)
from routing.replicas.peers import RemotePeers
from routing.replicas.prompt_hold import LIMIT_WINDOWS, PromptHold
from routing.replicas.shared_load import SharedLoad

WORKERS = ["w0", "w1", "w2", "w3"]


class Request:
    """What the hold sees of a request: it records when it was let go, and where to."""

    def __init__(self) -> None:
        self.done = False
        self.released = asyncio.Event()
        self.follow: str | None = None

    def hold_released(self, follow: str | None) -> None:
        self.follow = follow
        self.released.set()


class Replica:
    """One gateway replica's router, shares, peers and hold, beside one peer ("a" is rank 0
    of 2, "b" rank 1)."""

    def __init__(self, window_s: float = 10.0, replica_id: str = "a") -> None:
        self.id = replica_id
        self.load = SharedLoad(16)
        self.router = KvRouter(rng=random.Random(1), load=self.load)
        share = self.router.peer_share = PeerShare(replica_id)
        self.peer_id = "b" if replica_id == "a" else "a"
        share.set_peers([self.peer_id])
        self.peers = RemotePeers(self.router, self.load, timeout_s=3.0)
        self.hold = PromptHold(self.router, share, window_s)
        self.asked: list[tuple[str, AskedPrompt]] = []  # (owner, prompt) asked to claim
        self.was_asked = asyncio.Event()
        self.hold.ask_owner = self._asked
        self.seq = 0  # of the peer's batches heard here
        self.sent = 0  # of this replica's batches

    def _asked(self, owner: str, prompt: AskedPrompt) -> None:
        self.asked.append((owner, prompt))
        self.was_asked.set()

    def peer_batch(self, *events: Placed | FirstToken | Claimed) -> None:
        """A batch of the peer's, folded in as the link does."""
        self.seq += 1
        self.peers.apply(ReplicaBatch(self.peer_id, self.seq, False, list(events)))
        self.hold.heard()

    def peer_placed(self, worker_id: str, hashes: list[int]) -> None:
        self.peer_batch(Placed(f"k{self.seq}", worker_id, hashes, 16 * len(hashes),
                               16 * len(hashes)))

    def place(self, key: str, hashes: list[int]) -> str:
        """A session of this replica's own, placed at once (not held)."""
        assert not offer(self, Request(), hashes)
        placement = self.router.place(hashes, 16 * len(hashes), WORKERS)
        assert placement is not None
        self.router.dispatch(key, placement, hashes, 16 * len(hashes))
        return placement.worker_id

    def answer_claims(self, request: ClaimRequest) -> None:
        """A peer's claim request, read here (``ReplicaLink._on_claim``)."""
        assert request.replica_id == self.id
        for prompt in request.prompts:
            worker_id = self.hold.claim(prompt)
            if worker_id is not None:
                self.load.claimed(worker_id, prompt.block_hashes)

    def publish(self) -> ReplicaBatch:
        """This tick's batch, as the link sends it (through the wire codec)."""
        events, self.load.outbox = self.load.outbox, []
        self.sent += 1
        return decode_batch(encode(ReplicaBatch(self.id, self.sent, False, events)))


def offer(r: Replica, req: Request, hashes: list[int]) -> bool:
    return r.hold.offer(req, hashes, 16 * len(hashes), WORKERS)


def hear(receiver: Replica, batch: ReplicaBatch) -> None:
    receiver.peers.apply(batch)
    receiver.hold.heard()


def ask(asker: Replica, owner: Replica) -> None:
    """The asker's due claim requests, sent to the owner through the wire codec."""
    for owner_id, prompt in asker.asked:
        owner.answer_claims(decode_claim(encode(ClaimRequest(owner_id, [prompt]))))
    asker.asked.clear()


def blocks(owner_rank: int, n: int = 8, salt: int = 1) -> list[int]:
    """A prompt whose first block makes replica ``owner_rank`` (of 2) its owner."""
    first = salt * 1000 * 2 + owner_rank
    return [first, *(salt * 1000 * 2 + 2 * i + 7 for i in range(1, n))]


async def test_the_owner_places_a_new_prompt_at_once() -> None:
    r = Replica()
    assert not offer(r, Request(), blocks(owner_rank=0))
    assert len(r.hold) == 0 and r.hold.num_held == 0


async def test_held_until_the_owner_placement_is_heard_then_follows_it() -> None:
    r = Replica()
    prompt = blocks(owner_rank=1)
    req = Request()
    assert offer(r, req, prompt)
    r.peer_placed("w2", [99, 98])  # another prompt: still held
    assert not req.released.is_set() and len(r.hold) == 1
    r.peer_placed("w3", [*prompt[:6], 555])  # the owner placed a session with this prompt
    assert req.released.is_set() and len(r.hold) == 0
    assert req.follow == "w3"
    assert (r.hold.num_followed, r.hold.num_claimed, r.hold.num_timed_out) == (1, 0, 0)
    placement = r.router.place(prompt, 16 * len(prompt), WORKERS)
    assert placement is not None and placement.worker_id == "w3"


async def test_the_owner_asked_before_it_reads_its_own_session_claims_the_prompt() -> None:
    """The race a start-up burst ran: the owner has not read its own session of a new
    prompt (it waits in its socket) when the other replica's window ends. Asked, the owner
    claims the prompt where the asker proposed; its own session, read later, follows there:
    one copy."""
    owner, asker = Replica(replica_id="a"), Replica(window_s=0.002, replica_id="b")
    prompt = blocks(owner_rank=0)
    req = Request()
    assert offer(asker, req, prompt)
    await asyncio.wait_for(asker.was_asked.wait(), 5)  # the window's end
    assert [o for o, _ in asker.asked] == ["a"] and not req.released.is_set()
    proposed = asker.asked[0][1].proposed
    assert asker.router.peer_share is not None  # (the asker's share: "b" is rank 1)
    assert proposed in ("w1", "w3")
    ask(asker, owner)
    hear(asker, owner.publish())  # the owner's answer: Claimed
    assert req.released.is_set()
    assert req.follow == proposed
    assert (asker.hold.num_claimed, asker.hold.num_timed_out, owner.hold.num_claims) == (1, 0, 1)
    there = asker.place("b-1", prompt)
    assert there == req.follow
    assert owner.place("a-1", prompt) == there  # the owner's own session, read now


async def test_the_owner_that_placed_the_prompt_already_names_its_worker() -> None:
    """The other order: the owner reads its own session first and places it; asked before
    the asker has heard that placement, it answers with the same worker."""
    owner, asker = Replica(replica_id="a"), Replica(window_s=0.002, replica_id="b")
    prompt = blocks(owner_rank=0)
    worker = owner.place("a-1", prompt)
    placed = owner.publish()  # in flight to the asker, not heard yet
    req = Request()
    assert offer(asker, req, prompt)
    await asyncio.wait_for(asker.was_asked.wait(), 5)
    ask(asker, owner)
    assert owner.hold.num_claims == 0  # placed already: not placed again
    answer = owner.publish()
    assert answer.events == [Claimed(worker, prompt)]
    hear(asker, answer)  # (batches may come in any order here; either one releases it)
    assert req.released.is_set() and req.follow == worker
    assert asker.place("b-1", prompt) == worker
    hear(asker, placed)


async def test_prompts_held_together_are_proposed_as_if_placed_one_by_one() -> None:
    """The windows of a burst's held prompts end together: each proposal counts, here and
    not for the peers, as load on its worker until the request is placed, so the next
    proposal weighs it (weighed without each other, they all named the same worker)."""
    r = Replica(window_s=0.002, replica_id="b")
    reqs = [Request() for _ in range(4)]
    for salt, req in enumerate(reqs, 1):
        assert offer(r, req, blocks(owner_rank=0, n=64, salt=salt))
    while len(r.asked) < 4:
        await asyncio.wait_for(r.was_asked.wait(), 5)
        r.was_asked.clear()
    proposed = [p.proposed for _, p in r.asked]
    assert sorted(proposed) == ["w1", "w1", "w3", "w3"]  # spread over b's share
    assert r.load.snapshot() == [] and r.load.outbox == []  # nothing told to the peers
    assert r.load.in_flight() == 4
    assert [r.load.load(w).active_prefill_tokens for w in WORKERS] == [0, 2048, 0, 2048]
    r.hold.release_all()
    assert r.load.in_flight() == 0  # placed now: the reservations are gone


async def test_a_replica_that_does_not_own_the_prompt_claims_nothing() -> None:
    """Asked about a prompt it does not own (the replicas' views differ for a moment), or
    to a worker that is not the prompt's, a replica places nothing; the asker waits on (its
    limit at most)."""
    r = Replica(replica_id="a")
    assert r.hold.claim(AskedPrompt(blocks(owner_rank=1), WORKERS, "w1")) is None
    assert r.hold.claim(AskedPrompt(blocks(owner_rank=0), WORKERS, "w9")) is None
    assert r.hold.claim(AskedPrompt([], WORKERS, "w1")) is None
    assert r.load.outbox == [] and r.hold.num_claims == 0


async def test_placed_here_at_the_limit_when_the_owner_never_answers() -> None:
    r = Replica(window_s=0.002)
    req = Request()
    assert offer(r, req, blocks(owner_rank=1))
    assert r.hold.limit_s == pytest.approx(0.002 * LIMIT_WINDOWS)
    await asyncio.wait_for(req.released.wait(), 5)
    assert req.follow is None  # nothing heard: wherever it scores best
    assert [o for o, _ in r.asked] == ["b"]
    assert r.hold.num_timed_out == 1 and len(r.hold) == 0


async def test_only_the_owner_is_asked() -> None:
    """With three replicas, the prompt's owner is asked, and another's batches say nothing."""
    r = Replica(window_s=0.002)
    assert r.router.peer_share is not None
    r.router.peer_share.set_peers(["b", "c"])  # a, b, c: ranks 0, 1, 2
    prompt = [3 * 1000 + 2, 7, 9]  # owner rank 2: "c"
    req = Request()
    assert offer(r, req, prompt)
    r.peer_batch()  # from "b"
    await asyncio.wait_for(r.was_asked.wait(), 5)
    assert [o for o, _ in r.asked] == ["c"] and not req.released.is_set()
    r.hold.release_all()


async def test_a_prompt_the_cache_prefers_a_worker_for_is_not_held() -> None:
    r = Replica()
    prompt = blocks(owner_rank=1)
    r.peer_placed("w1", prompt[:3])  # predicted on w1: the prefix decides
    assert r.hold.owner_of(prompt, WORKERS) is None
    assert not offer(r, Request(), prompt)


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
    assert offer(r, req, blocks(owner_rank=1))
    assert offer(r, other, blocks(owner_rank=1, salt=2))
    req.done = True
    await asyncio.wait_for(other.released.wait(), 5)
    assert not req.released.is_set()


async def test_alone_again_releases_every_held_prompt() -> None:
    r = Replica()
    req = Request()
    assert offer(r, req, blocks(owner_rank=1))
    assert r.router.peer_share is not None
    r.router.peer_share.set_peers([])  # the peer is gone
    r.hold.heard()  # as the link calls it when the peers change
    assert req.released.is_set()


async def test_no_hold_when_turned_off_or_alone() -> None:
    assert not offer(Replica(window_s=0), Request(), blocks(owner_rank=1))
    alone = Replica()
    assert alone.router.peer_share is not None
    alone.router.peer_share.set_peers([])
    assert not offer(alone, Request(), blocks(owner_rank=1))
    with pytest.raises(ValueError, match=">= 0"):
        PromptHold(alone.router, alone.router.peer_share, -1)


async def test_both_replicas_agree_on_the_owner() -> None:
    a, b = Replica(replica_id="a"), Replica(replica_id="b")
    for salt in range(1, 20):
        for rank in (0, 1):
            prompt = blocks(owner_rank=rank, salt=salt)
            held_a = offer(a, Request(), prompt)
            held_b = offer(b, Request(), prompt)
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
    assert offer(r, Request(), prompt)
    r.hold.release_all()
    short = [*head, 5001, 7]  # 4 blocks: no head allowed, w0 holds half of it
    assert r.hold.owner_of(short, WORKERS) is None
