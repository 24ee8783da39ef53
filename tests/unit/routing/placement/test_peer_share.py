"""PeerShare: new prefixes spread over gateway replicas that cannot see each other yet."""

from __future__ import annotations

import random

import pytest

from routing.placement.kv_router import KvRouter
from routing.placement.peer_share import PeerShare, new_prompt_depth
from routing.placement.scorer import Candidate, Pool, TierOverlap, WorkerLoad

WORKERS = ["w0", "w1", "w2", "w3"]


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def candidates(*depths: int) -> list[Candidate]:
    pairs = zip(WORKERS, depths, strict=False)
    return [Candidate(w, TierOverlap(d), WorkerLoad(100, 10)) for w, d in pairs]


def router(name: str, peers: list[str], clock: Clock, seed: int) -> KvRouter:
    r = KvRouter(rng=random.Random(seed), clock=clock)
    r.peer_share = PeerShare(name, clock=clock)
    r.peer_share.set_peers(peers)
    return r


def place(r: KvRouter, key: str, salt: int, n_blocks: int = 50) -> str:
    blocks = [salt * 10_000 + i for i in range(n_blocks)]
    placement = r.place(blocks, n_blocks * 16, WORKERS)
    assert placement is not None
    r.dispatch(key, placement, blocks, n_blocks * 16)
    return placement.worker_id


def test_rank_and_share_follow_the_sorted_replica_ids() -> None:
    share = PeerShare("b")
    assert (share.rank, share.count) == (0, 1)
    share.set_peers(["c", "a"])
    assert (share.rank, share.count) == (1, 3)
    share.set_peers([])
    assert (share.rank, share.count) == (0, 1)


def test_alone_or_with_a_preferred_worker_nothing_changes() -> None:
    share = PeerShare("a")
    cands = candidates(0, 0, 0, 0)
    assert share.adjust(cands) is cands  # no peers
    share.set_peers(["b"])
    share.placed(800, 50)
    uneven = candidates(3, 0, 0, 0)
    assert share.adjust(uneven) is uneven  # the cache prefers w0: untouched
    assert share.num_spread == 0


def test_new_prefix_loads_the_peers_workers_with_what_this_replica_placed() -> None:
    clock = Clock()
    share = PeerShare("a", window_s=0.25, clock=clock)
    share.set_peers(["b"])  # a: w0, w2; b: w1, w3
    share.placed(800, 50)
    share.placed(801, 51)
    got = {c.worker_id: c.load for c in share.adjust(candidates(2, 2, 2, 2))}
    assert got["w0"] == got["w2"] == WorkerLoad(100, 10)
    # 1601 tokens and 101 blocks over two workers of a's share, rounded up, +1 token
    assert got["w1"] == got["w3"] == WorkerLoad(100 + 801 + 1, 10 + 51)
    assert share.num_spread == 1
    clock.now += 0.3  # past the window: the peers' own synced load speaks for them
    got = {c.worker_id: c.load for c in share.adjust(candidates(0, 0, 0, 0))}
    assert got["w1"] == WorkerLoad(101, 10)


def test_more_replicas_than_workers_leaves_the_extra_replica_unbiased() -> None:
    share = PeerShare("c")
    share.set_peers(["a", "b"])  # rank 2 of 3 over two workers: no share of its own
    cands = candidates(0, 0)
    assert share.adjust(cands) is cands


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_s"):
        PeerShare("a", window_s=0)


def test_two_replicas_that_never_hear_each_other_spread_new_prefixes_like_one() -> None:
    """The burst the shares are for: 12 new prefixes through two replicas, alternately, with
    no message between them; each worker gets 3, as one gateway places them."""
    clock = Clock()
    a, b = router("a", ["b"], clock, 1), router("b", ["a"], clock, 2)
    chosen = [place((a, b)[i % 2], f"k{i}", salt=i) for i in range(12)]
    assert sorted(chosen.count(w) for w in WORKERS) == [3, 3, 3, 3]


def test_a_decode_pool_places_by_room_alone() -> None:
    """The presumed load never counts against a decode worker's room: with this replica's
    own decode worker full, the peer's, with room, is chosen rather than none."""
    clock = Clock()
    r = router("a", ["b"], clock, 1)  # a's share: w0 (of w0, w1)
    r.load.set_capacity("w0", 40)
    r.load.set_capacity("w1", 100)
    r.peer_share.placed(800, 60)  # type: ignore[union-attr]
    blocks = list(range(50))
    placement = r.place(blocks, 800, ["w0", "w1"], pool=Pool.DECODE)
    assert placement is not None and placement.worker_id == "w1"


def chat(system: int, user: int) -> list[int]:
    """A 125-block system prompt shared by its sessions, then 3 blocks of one user's turn."""
    return [system * 10_000 + i for i in range(125)] + [
        system * 10_000 + 1_000 + user * 10 + i for i in range(3)
    ]


def burst_twice(r: KvRouter, clock: Clock, prompts: int) -> list[tuple[str, str]]:
    """``prompts`` new system prompts, one session each, then a second session of each, 5 ms
    apart (0.2 s in all): where each prompt's first and second session went."""
    first: dict[int, str] = {}
    pairs = []
    for rnd in range(2):
        for s in range(prompts):
            blocks = chat(s, rnd)
            placement = r.place(blocks, len(blocks) * 16, WORKERS)
            assert placement is not None
            r.dispatch(f"k{rnd}-{s}", placement, blocks, len(blocks) * 16)
            clock.now += 0.005
            if rnd == 0:
                first[s] = placement.worker_id
            else:
                pairs.append((first[s], placement.worker_id))
    return pairs


def test_the_second_session_of_a_new_prompt_follows_the_first_as_with_one_gateway() -> None:
    """Two sessions of the same new system prompt through one synced replica within 0.5 s
    (the peer's own burst not heard yet): the second goes where the first went, as through
    one gateway, though the share's workers look busier than the peer's."""
    clock = Clock()
    alone = KvRouter(rng=random.Random(1), clock=clock)
    assert all(a == b for a, b in burst_twice(alone, clock, 20))
    synced = router("a", ["b"], clock, 1)  # a: w0, w2
    pairs = burst_twice(synced, clock, 20)
    assert {w for w, _ in pairs} == {"w0", "w2"}  # the new prompts spread over a's share
    assert all(a == b for a, b in pairs)


def test_a_prefix_predicted_on_this_share_counts_as_new_one_on_a_peers_does_not() -> None:
    """Equal stored depths: a deeper prediction on this replica's own worker keeps the
    presumed load on the others; one only on a peer's worker (its placement in flight)
    leaves every load as it is, and so does a stored difference."""
    share = PeerShare("a")
    share.set_peers(["b"])  # a: w0, w2
    share.placed(800, 50)
    mine = candidates(7, 0, 0, 0)
    got = {c.worker_id: c.load for c in share.adjust(mine, [0, 0, 0, 0])}
    assert got["w0"] == got["w2"] == WorkerLoad(100, 10)
    assert got["w1"] == got["w3"] == WorkerLoad(100 + 400 + 1, 10 + 25)  # over 2 workers
    peers = candidates(0, 7, 0, 0)
    assert share.adjust(peers, [0, 0, 0, 0]) is peers
    assert share.adjust(mine, [7, 0, 0, 0]) is mine  # stored: the cache decides


def test_a_prompt_a_peer_is_placing_is_followed_through_this_replica() -> None:
    """A peer's placement heard while its prefill runs (a prediction on the peer's worker):
    the same prompt through this replica goes there too, however busy this replica was."""
    clock = Clock()
    r = router("a", ["b"], clock, 1)  # a: w0, w2
    for i in range(10):
        place(r, f"k{i}", salt=i)  # this replica's own burst: a large presumed load
    blocks = chat(99, 0)
    r.pending.record("w1", blocks[:125], clock.now)  # what RemotePeers does for b's Placed
    placement = r.place(blocks, len(blocks) * 16, WORKERS)
    assert placement is not None and placement.worker_id == "w1"


@pytest.mark.parametrize(("depths", "n_blocks", "expected"), [
    ([0, 0, 0, 0], 10, 0),
    ([3, 3, 3, 3], 10, 3),
    ([1, 0, 0, 2], 32, 2),  # a shared head of up to 32/16 blocks held unevenly
    ([3, 0, 0, 0], 32, None),  # more than that: the cache prefers a worker
    ([1, 0, 0, 0], 15, None),  # a short prompt: no head is shared
])
def test_new_prompt_depth(depths: list[int], n_blocks: int, expected: int | None) -> None:
    assert new_prompt_depth(depths, n_blocks) == expected


def test_a_shared_head_held_unevenly_still_spreads_a_new_prompt() -> None:
    share = PeerShare("a")
    share.set_peers(["b"])
    share.placed(1000, 10)
    candidates = [Candidate(w, TierOverlap(d), WorkerLoad(100, 10))
                  for w, d in zip(WORKERS, [1, 0, 0, 0], strict=True)]
    assert share.adjust(candidates, [1, 0, 0, 0]) is candidates  # no head allowed
    spread = share.adjust(candidates, [1, 0, 0, 0], n_blocks=32)
    assert spread is not candidates
    assert [c.load.active_prefill_tokens > 100 for c in spread] == [False, True, False, True]
