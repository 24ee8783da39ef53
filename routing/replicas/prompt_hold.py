"""A new prompt waits, on the replica that does not own it, for the one that does.

Two gateway replicas behind a round-robin balancer both receive a burst of new
conversations, and often the same new system prompt through both within a few milliseconds:
each places its copy before it hears of the other's (tens of milliseconds over NATS on a busy
host), in its own share of the workers (``routing.placement.peer_share``), so the prompt is
computed and cached twice, and on a capacity-bound fleet the extra copies evict what the next
turns needed (docs/bench/replicas.md). Only an agreement made before either replica places
the prompt keeps it whole, and neither can ask the other in time.

So every new prompt has an owner, which both compute alike: the replica of rank
``key mod count``, where ``key`` is the prompt's first block that no worker holds, and the
ranks are the live replicas sorted by id (``PeerShare``). A prompt is *new* while the cache
prefers no worker for it: every candidate's overlap, stored or predicted, is the same, give
or take a head many prompts share (``new_prompt_depth``), and ``key`` is the block just past
the deepest. Only the owner decides where a new prompt goes first: it places its own
sessions of it at once, and any other replica holds its sessions until one of:

* the owner's placement of it is heard (a peer's batch makes the prompt predicted on the
  owner's worker: no longer new, so the request follows it);
* ``window_s`` passes: this replica asks the owner to place the prompt (``ask_owner``, a
  ``ClaimRequest``) on the worker it proposes (its own scorer's choice, in its own share of
  the workers), and the owner, reading the question on its event loop, *claims* it: a
  prompt still new to it goes where proposed, and is predicted there; one it has placed
  already is named where it is predicted deepest. Its answer (``Claimed``) makes the prompt
  predicted on that worker here: followed as above. The owner's event loop orders its own
  sessions of the prompt and the question, so whichever it reads first decides and the
  other follows: no two replicas place a new prompt's first copies, however late either
  reads its requests. (Before, a held prompt was placed here once the owner's batches said
  it had read every request from before the window's end without it; but a request can
  wait where no batch sees it, such as a new connection in the owner's listening socket,
  and in a start-up burst 0 to 4 prompts a run got two copies: docs/bench/replicas.md.)
  A new prompt goes to the share of the replica whose session of it came first, as before
  claims, so a burst's new prompts stay spread as they arrive, half through each replica;
* ``limit_s`` passes (``LIMIT_WINDOWS`` windows): the owner never answered;
* the peers change, so the owner may be this replica now.

The merge window is what one gateway gives for free: two sessions of a new prompt arriving
within it, one through each replica, end on one worker. A request holds once, and occupies
no worker while held. The cost is the window plus the owner's answer (the limit at most) on
new prompts at the replicas that do not own them; nothing alone, or with ``window_s`` 0.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from routing.placement.active_load import RESERVED_MARK
from routing.placement.kv_router import KvRouter
from routing.placement.peer_share import PeerShare, new_prompt_depth
from routing.replicas.messages import AskedPrompt

__all__ = ["LIMIT_WINDOWS", "HeldPrompt", "PromptHold"]

LIMIT_WINDOWS = 20  # a hold ends at this many windows, whatever was heard


class HeldPrompt(Protocol):
    """A request that may be held (the gateway's exchange)."""

    done: bool  # answered or abandoned meanwhile: nothing to release

    def hold_released(self, follow: str | None) -> None:
        """Place it now (it will not be held again); on ``follow`` while that worker is
        eligible, where the prompt's owner put it (None: wherever it scores best)."""


@dataclass(slots=True)
class _Held:
    waiter: HeldPrompt
    block_hashes: Sequence[int]
    prompt_tokens: int
    worker_ids: Sequence[str]
    asked: bool = False  # its owner was asked to place it
    reserved: str | None = None  # the key of its load, counted where it was proposed
    timer: asyncio.TimerHandle | None = None


class PromptHold:
    """The requests this replica holds for their prompts' owners; and, as an owner, the
    prompts it claims when a peer asks."""

    def __init__(self, router: KvRouter, share: PeerShare, window_s: float) -> None:
        if window_s < 0:
            raise ValueError(f"the new-prompt window must be >= 0 s, got {window_s}")
        self._router = router
        self._share = share
        self.window_s = window_s
        self.limit_s = window_s * LIMIT_WINDOWS
        # asks the replica of this id to place this prompt (``ReplicaLink``: a ClaimRequest)
        self.ask_owner: Callable[[str, AskedPrompt], None] = _ask_nobody
        self._held: list[_Held] = []
        self._next_reservation = 0
        self.num_held = 0  # requests held, ever
        self.num_followed = 0  # released: the owner's placement was heard (or peers changed)
        self.num_claimed = 0  # released once the owner was asked: its answer was heard
        self.num_timed_out = 0  # released at limit_s: nothing heard from the owner
        self.num_claims = 0  # prompts this replica placed as their owner, asked by a peer

    def __len__(self) -> int:
        return len(self._held)

    def owner_of(self, block_hashes: Sequence[int], worker_ids: Sequence[str]) -> int | None:
        """The rank of the replica that places this prompt first, if it is new; else None."""
        if not block_hashes or len(worker_ids) < 2:
            return None
        depths = [c.overlap.longest for c in self._router.candidates(block_hashes, worker_ids)]
        depth = new_prompt_depth(depths, len(block_hashes))
        if depth is None or depth >= len(block_hashes):
            return None  # the cache (or a placement in flight) prefers a worker
        return block_hashes[depth] % self._share.count

    def offer(
        self,
        waiter: HeldPrompt,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        worker_ids: Sequence[str],
    ) -> bool:
        """Hold ``waiter`` if its prompt is new and another replica owns it: True when held
        (``waiter.hold_released`` places it later), False to place it now."""
        share = self._share
        if self.window_s == 0 or share.count == 1:
            return False
        owner = self.owner_of(block_hashes, worker_ids)
        if owner is None or owner == share.rank:
            return False
        held = _Held(waiter, block_hashes, prompt_tokens, list(worker_ids))
        held.timer = asyncio.get_running_loop().call_later(self.window_s, self._window_ended,
                                                           held)
        self._held.append(held)
        self.num_held += 1
        return True

    def heard(self) -> None:
        """A peer's batch was folded in, or the peers changed: release each held prompt that
        is no longer new (its owner placed or claimed it) or no longer another's."""
        if not self._held:
            return
        share = self._share
        keep: list[_Held] = []
        released: list[_Held] = []
        for held in self._held:
            if held.waiter.done:
                self._drop(held)
                continue
            owner = self.owner_of(held.block_hashes, held.worker_ids)
            if owner is None or owner == share.rank or share.count == 1:
                released.append(held)
            else:
                keep.append(held)
        self._held = keep
        for held in released:
            if held.asked:
                self.num_claimed += 1
            else:
                self.num_followed += 1
            self._release(held, self._placed_on(held.block_hashes, held.worker_ids))

    def claim(self, prompt: AskedPrompt) -> str | None:
        """A peer holds a session of ``prompt`` and asks this replica, its owner, to place it:
        the worker it goes to, predicted there from now on. Still new here, where the peer
        proposed (and this replica's own sessions of it follow there); placed already, here
        or by another replica, where it is predicted deepest. None when this replica does
        not own it (the two replicas' views of it differ: the asker's hold ends when they
        agree, or at its limit) or the proposed worker is not one of the prompt's."""
        hashes, worker_ids = prompt.block_hashes, prompt.worker_ids
        if not hashes or prompt.proposed not in worker_ids:
            return None
        placed = self._placed_on(hashes, worker_ids)
        if placed is not None:
            return placed
        if self.owner_of(hashes, worker_ids) != self._share.rank:
            return None
        self._router.predict(prompt.proposed, hashes)
        self.num_claims += 1
        return prompt.proposed

    def release_all(self) -> None:
        """Place every held request now (the gateway stops, or the peers changed)."""
        held, self._held = self._held, []
        for h in held:
            self._release(h)

    def _window_ended(self, held: _Held) -> None:
        """Ask the owner to place the prompt where this replica would; wait for its answer up
        to the limit."""
        share = self._share
        owner = self.owner_of(held.block_hashes, held.worker_ids)
        if owner is not None and owner != share.rank:
            router = self._router
            proposed = router.place(held.block_hashes, held.prompt_tokens, held.worker_ids)
            if proposed is not None:
                held.asked = True
                # Weighed from now on as if placed: its load there until it is placed, and
                # in this replica's recent placements (so in the load presumed on the
                # peers' shares: counted again when it is placed, for the rest of the
                # shares' window). The windows of a burst's held prompts end together, and
                # proposals weighed without each other all named the same worker; with the
                # load alone, the shares looked uneven and they left this one
                # (docs/bench/replicas.md).
                self._next_reservation += 1
                held.reserved = f"{RESERVED_MARK}held-{self._next_reservation}"
                router.load.reserve(held.reserved, proposed.worker_id, held.block_hashes,
                                    held.prompt_tokens)
                share.placed(held.prompt_tokens, len(held.block_hashes))
                self.ask_owner(share.replicas[owner], AskedPrompt(
                    held.block_hashes, held.worker_ids, proposed.worker_id))
        held.timer = asyncio.get_running_loop().call_later(
            self.limit_s - self.window_s, self._timed_out, held)

    def _timed_out(self, held: _Held) -> None:
        held.timer = None
        try:
            self._held.remove(held)
        except ValueError:
            return  # released meanwhile
        self.num_timed_out += 1
        self._release(held)

    def _placed_on(self, block_hashes: Sequence[int], worker_ids: Sequence[str]) -> str | None:
        """The worker a prompt released from its hold follows: where it is predicted (or
        held) deepest, once that is deeper than elsewhere (its owner's placement or claim);
        None while the cache prefers no worker. The owner chose it as one gateway would have
        chosen for the prompt's first session, and its scorer here would not: the prompt's
        blocks are credited there although nothing computes them yet (a claim holds no
        load), and this replica's view of the owner's burst lags. Scored again, 3 to 5
        sessions a run went elsewhere in a start-up burst (docs/bench/replicas.md)."""
        candidates = self._router.candidates(block_hashes, worker_ids)
        depths = [c.overlap.longest for c in candidates]
        if new_prompt_depth(depths, len(block_hashes)) is not None:
            return None
        return max(candidates, key=lambda c: c.overlap.longest).worker_id

    def _release(self, held: _Held, follow: str | None = None) -> None:
        self._drop(held)
        if not held.waiter.done:
            held.waiter.hold_released(follow)

    def _drop(self, held: _Held) -> None:
        """Stop its timer and its reservation."""
        if held.timer is not None:
            held.timer.cancel()
            held.timer = None
        if held.reserved is not None:
            self._router.load.unreserve(held.reserved)
            held.reserved = None


def _ask_nobody(replica_id: str, prompt: AskedPrompt) -> None:
    return None
