"""New prefixes spread across gateway replicas that cannot yet see each other's placements.

Two replicas behind a round-robin balancer each receive half of a burst of new
conversations. A prefix no worker holds is placed by load alone, and each replica sees its
peers' placements only after they cross NATS (milliseconds later, more on a busy host): in
the burst both put their new prefixes on the workers that look idle to them, the same ones.
Measured on ``scripts/bench_replicas.py``: one gateway spreads 12 conversation groups 3/3/3/3
over 4 workers, two synced replicas 4/3/3/2, and the group that gets the crowded worker's
cache thrashes for the rest of the run (docs/bench/replicas.md).

So each replica takes a share of the workers for new prefixes: the workers sorted by id,
every ``count``-th one from its rank among the live replicas (sorted by id, so every replica
computes the same shares). For a request whose overlap is the same on every candidate (a
new prefix: the cache prefers no worker), a worker outside this replica's share counts the
load its owner is presumed to have put there unseen: what this replica itself placed over
the last ``window_s`` (prefill and held blocks), per worker of its own share, since the
replicas see the same traffic. Within the window the shares keep apart; past it the peers'
real load, synced, takes over, and a replica that gets more traffic than its share still
spills onto the others' workers once its own are that much busier. A request that some
worker holds more of than another is untouched: the cache decides as before.

What a worker is predicted to hold (``PendingPrefixes``: a placement still prefilling) is
not held yet. A prompt this replica has just placed on a worker of its share, under the
presumed load, is still new: the next session with the same prompt is weighed against the
same presumed load, so it follows the first, as through one gateway. Weighed without it,
the share's workers, busy with the burst this replica placed, looked dearer than the
others', whose burst (the peer's) it had not heard yet, and the second session went there:
49 of 56 such pairs within 0.5 s on the capacity-bound load of ``scripts/bench_replicas.py``,
0 of 104 through one gateway, each prompt on 2.37 workers instead of 1.73
(docs/bench/replicas.md). A prompt predicted deepest only on the others' workers is a peer's
placement in flight (``RemotePeers``): it is left to follow that.

Pure and synchronous, clock injected; one replica alone (``count`` 1) changes nothing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from routing.placement.scorer import Candidate

__all__ = ["HEAD_SHARE", "PeerShare", "new_prompt_depth"]

# Leading blocks held unevenly, up to this share of the prompt's blocks, are a head many
# prompts share (a chat template's preamble: Llama 3.1's dates fill its first block), not a
# reason to prefer a worker: the prompt is still new.
HEAD_SHARE = 1 / 16


def new_prompt_depth(depths: Sequence[int], n_blocks: int) -> int | None:
    """How many leading blocks of a prompt of ``n_blocks`` the workers hold (``depths``, one
    per worker), when the cache prefers no worker for it: every worker holds as many, give
    or take a shared head (``HEAD_SHARE``); then the deepest. None when one worker holds
    materially more than another."""
    deepest = max(depths)
    if deepest - min(depths) > int(n_blocks * HEAD_SHARE):
        return None
    return deepest


class PeerShare:
    """This replica's share of the workers for new prefixes, and the load presumed unseen
    on the others'."""

    def __init__(
        self, replica_id: str, window_s: float = 0.25, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.replica_id = replica_id
        self.window_s = window_s
        self._clock = clock
        self.rank = 0
        self.count = 1
        self.replicas = [replica_id]  # the live replicas' ids, sorted: rank → id
        self._recent: deque[tuple[float, int, int]] = deque()  # (placed at, prefill, blocks)
        self._recent_tokens = 0  # prefill tokens placed within the window
        self._recent_blocks = 0  # and the blocks those requests hold
        self.num_spread = 0  # requests scored with the peers' presumed load

    def set_peers(self, peer_ids: Iterable[str]) -> None:
        """The live replicas besides this one (heard over NATS), whenever they change."""
        replicas = self.replicas = sorted({self.replica_id, *peer_ids})
        self.rank = replicas.index(self.replica_id)
        self.count = len(replicas)

    def placed(self, prefill_tokens: int, blocks: int) -> None:
        """This replica placed a request (any request): the prefill it left to do and the
        blocks it holds, as ``ActiveLoad`` counts them."""
        if self.count == 1:
            return
        now = self._clock()
        self._expire(now)
        self._recent.append((now, prefill_tokens, blocks))
        self._recent_tokens += prefill_tokens
        self._recent_blocks += blocks

    def adjust(
        self,
        candidates: Sequence[Candidate],
        stored_depths: Sequence[int] | None = None,
        n_blocks: int = 0,
    ) -> Sequence[Candidate]:
        """``candidates`` with the presumed unseen load on workers outside this replica's
        share, when the request is a new prefix; otherwise ``candidates`` themselves.

        ``stored_depths``: per candidate, the leading blocks its cache holds, without the
        blocks only predicted there by placements still in flight (``KvRouter.candidates``);
        None: every overlap is stored. A prefix no cache holds more of on one worker than on
        another is new, even once a placement in flight predicts it on a worker of this
        share (the same new prompt twice in a burst: the second follows the first, as the
        first was chosen, against the same presumed load); but one predicted deepest only on
        the others' workers, where a peer's placement is taking it, is left to follow it.
        ``n_blocks``: the prompt's, for how much of a shared head may differ
        (``new_prompt_depth``; 0: nothing may)."""
        count = self.count
        if count == 1 or len(candidates) < 2:
            return candidates
        if stored_depths is None:
            stored_depths = [c.overlap.longest for c in candidates]
        if new_prompt_depth(stored_depths, n_blocks) is None:
            return candidates  # the cache prefers a worker
        ids = sorted(c.worker_id for c in candidates)
        mine = set(ids[self.rank :: count])
        if not mine or len(mine) == len(ids):
            return candidates
        deepest = max(c.overlap.longest for c in candidates) - int(n_blocks * HEAD_SHARE)
        if all(c.overlap.longest < deepest for c in candidates if c.worker_id in mine):
            return candidates  # predicted on a peer's worker only
        self._expire(self._clock())
        share = len(mine)
        # +1: at equal load a worker of this replica's share wins the tie.
        tokens = -(-self._recent_tokens // share) + 1
        blocks = -(-self._recent_blocks // share)
        self.num_spread += 1
        return [
            c if c.worker_id in mine else replace(c, load=replace(
                c.load, active_prefill_tokens=c.load.active_prefill_tokens + tokens,
                decode_blocks=c.load.decode_blocks + blocks))
            for c in candidates
        ]

    def _expire(self, now: float) -> None:
        recent, limit = self._recent, now - self.window_s
        while recent and recent[0][0] <= limit:
            _, tokens, blocks = recent.popleft()
            self._recent_tokens -= tokens
            self._recent_blocks -= blocks
