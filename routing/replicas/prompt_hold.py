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
the deepest. The owner places a new prompt at
once. Any other replica holds it until one of:

* the owner's placement of it is heard (a peer's batch makes the prompt predicted on the
  owner's worker: no longer new, so the request follows it);
* a batch of the owner's *settled* ``window_s`` or more after the hold began is heard
  without it: the owner had read and placed, held or answered every request that reached it
  by then, so it had not seen the prompt, and this replica places it (the owner, hearing
  that, follows it in turn). A batch carries its sender's wall clock as of which it has
  settled (``settled_at``, see ``ReplicaLink``): not its sending, since a busy owner has
  requests it has not read yet, nor those it is still tokenizing in a thread
  (``preparing``). At the window's end this replica asks the owner for such a batch
  (``ask_owner``): an idle owner answers at once, a busy one once it has caught up. In a
  start-up burst that is tens of requests queued on each replica's event loop, half a
  second on a busy host, and a hold that ended at a fixed time placed a second copy of the
  prompt while the owner was still reading its session of it (docs/bench/replicas.md);
* ``limit_s`` passes (``LIMIT_WINDOWS`` windows): the owner never answered;
* the peers change, so the owner may be this replica now.

The merge window is what one gateway gives for free: two sessions of a new prompt arriving
within it, one through each replica, end on one worker. A request holds once, and occupies
no worker while held. The cost is the window plus NATS' latency (the limit at most) on new
prompts at the replicas that do not own them; nothing alone, or with ``window_s`` 0.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from routing.placement.kv_router import KvRouter
from routing.placement.peer_share import PeerShare, new_prompt_depth

__all__ = ["LIMIT_WINDOWS", "HeldPrompt", "PromptHold"]

LIMIT_WINDOWS = 20  # a hold ends at this many windows, whatever was heard


class HeldPrompt(Protocol):
    """A request that may be held (the gateway's exchange)."""

    done: bool  # answered or abandoned meanwhile: nothing to release

    def hold_released(self) -> None:
        """Place it now (it will not be held again)."""


@dataclass(slots=True)
class _Held:
    waiter: HeldPrompt
    block_hashes: Sequence[int]
    worker_ids: Sequence[str]
    until: float  # wall clock: an owner's batch settled from then on releases it
    timer: asyncio.TimerHandle | None = None


class PromptHold:
    """The requests this replica holds for their prompts' owners."""

    def __init__(
        self,
        router: KvRouter,
        share: PeerShare,
        window_s: float,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if window_s < 0:
            raise ValueError(f"the new-prompt window must be >= 0 s, got {window_s}")
        self._router = router
        self._share = share
        self.window_s = window_s
        self.limit_s = window_s * LIMIT_WINDOWS
        # asks the replica of this id for a batch settled as of now (``ReplicaLink``)
        self.ask_owner: Callable[[str], None] = _ask_nobody
        self._wall_clock = wall_clock
        self._held: list[_Held] = []
        self._preparing: dict[int, float] = {}  # request token → its arrival (wall clock)
        self._next_token = 0
        self.num_held = 0  # requests held, ever
        self.num_followed = 0  # released: the owner's placement was heard (or peers changed)
        self.num_passed = 0  # released: the owner's batches passed the window without it
        self.num_timed_out = 0  # released at limit_s: nothing heard from the owner

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
        self, waiter: HeldPrompt, block_hashes: Sequence[int], worker_ids: Sequence[str]
    ) -> bool:
        """Hold ``waiter`` if its prompt is new and another replica owns it: True when held
        (``waiter.hold_released`` places it later), False to place it now."""
        share = self._share
        if self.window_s == 0 or share.count == 1:
            return False
        owner = self.owner_of(block_hashes, worker_ids)
        if owner is None or owner == share.rank:
            return False
        held = _Held(waiter, block_hashes, worker_ids, self._wall_clock() + self.window_s)
        held.timer = asyncio.get_running_loop().call_later(self.window_s, self._window_ended,
                                                           held)
        self._held.append(held)
        self.num_held += 1
        return True

    def preparing(self) -> int:
        """A request arrived that is prepared off the event loop: until ``prepared`` (its
        token), this replica has settled only up to its arrival."""
        self._next_token += 1
        self._preparing[self._next_token] = self._wall_clock()
        return self._next_token

    def prepared(self, token: int) -> None:
        """The request ``preparing`` returned ``token`` for is placed, held or answered."""
        self._preparing.pop(token, None)

    def settled_at(self, read_at: float) -> float:
        """The wall clock as of which every request this replica received is placed, held
        or answered, given that it has read every request that reached it by ``read_at``:
        the oldest arrival still being prepared off the loop, else ``read_at``."""
        return min(self._preparing.values(), default=read_at)

    def heard(self, peer_id: str | None = None, settled_at: float = 0.0) -> None:
        """A batch of ``peer_id``'s, settled as of ``settled_at`` (its wall clock), was folded
        in, or (no peer) the peers changed: release each held prompt that is no longer new
        (the owner placed it), no longer another's, or that the owner has settled past."""
        if not self._held:
            return
        share = self._share
        rank, replicas = share.rank, share.replicas
        keep: list[_Held] = []
        followed: list[_Held] = []
        passed: list[_Held] = []
        for held in self._held:
            if held.waiter.done:
                _cancel(held)
                continue
            owner = self.owner_of(held.block_hashes, held.worker_ids)
            if owner is None or owner == rank or share.count == 1:
                followed.append(held)
            elif peer_id == replicas[owner] and settled_at >= held.until:
                passed.append(held)
            else:
                keep.append(held)
        self._held = keep
        self.num_followed += len(followed)
        self.num_passed += len(passed)
        for held in (*followed, *passed):
            self._release(held)

    def release_all(self) -> None:
        """Place every held request now (the gateway stops, or the peers changed)."""
        held, self._held = self._held, []
        for h in held:
            self._release(h)

    def _window_ended(self, held: _Held) -> None:
        """Ask the owner for a batch settled as of now; wait for it up to the limit."""
        share = self._share
        owner = self.owner_of(held.block_hashes, held.worker_ids)
        if owner is not None and owner != share.rank:
            self.ask_owner(share.replicas[owner])
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

    def _release(self, held: _Held) -> None:
        _cancel(held)
        if not held.waiter.done:
            held.waiter.hold_released()


def _ask_nobody(replica_id: str) -> None:
    return None


def _cancel(held: _Held) -> None:
    if held.timer is not None:
        held.timer.cancel()
        held.timer = None
