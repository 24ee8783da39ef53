"""Placement cost and selection: which worker a request should go to.

The cost of placing a request on a worker, lowest wins (Dynamo's default "linear" selector,
``lib/kv-router/src/scheduling/selector/default.rs`` in Dynamo's repository)::

    prefill_blocks_after_credit = (active_prefill_tokens + prompt_tokens) / block_size
                                  − overlap_weight·gpu − host_weight·host
                                  − disk_weight·disk − remote_weight·remote
    cost = prefill_load_scale × prefill_blocks_after_credit + decode_blocks

Unlike Dynamo we do not clamp the credited prefill at zero. With credit weights of at most 1
(the defaults) the credit never exceeds the prompt's own blocks, so nothing changes; with an
``overlap_weight`` above 1 (a cached block valued above a block of queued work, which keeps
conversations on the worker that holds them) a clamp would rank every worker whose credit
covers its queue equal, and the decode term alone would pick among them, scattering
conversations: on the Mooncake conversation trace that costs a quarter of the hit rate
(see docs/bench/replay.md).

(``prefill_load_scale`` is Dynamo's knob, default 1: how much a block of prefill work weighs
against a block held by a decoding request; prefill is far more compute per block, so traffic
with long shared prefixes places better with it raised, see docs/bench/replay.md), where
``decode_blocks`` counts the blocks held by the worker's active requests plus this
request's. Tier credits are *incremental*: a block is credited once, at the fastest tier that
holds it, i.e. ``host`` counts the leading blocks found in host memory beyond the GPU match.
With exclusive tiers (a block lives in one tier at a time, the usual offload) that is exactly
the sum in the formula above; with write-through tiers (a block in GPU and host at once) it
avoids crediting the same block twice.

Selection: at temperature 0 the arg-min wins; ties go to the larger total overlap (so
back-to-back identical prompts stay together), then uniformly at random. At temperature T > 0
costs are min-max normalized to [0, 1] and a worker is drawn with probability ∝ exp(−cost/T).

A learned decode-interference term (``decode_price.py``) adds, for an aggregated worker, the
decode time its streams would lose to one more request, in the same units; without it (none
learned yet, or ``--decode-interference-weight 0``) the cost is the formula above.

Disaggregated pools score differently: the prefill pool by overlap and prefill load only,
the decode pool by how full each worker would be (decode blocks over capacity).
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from routing.placement.decode_price import DecodePrice

__all__ = [
    "Candidate",
    "Placement",
    "Pool",
    "Reason",
    "Scorer",
    "ScoringWeights",
    "TierOverlap",
    "WorkerLoad",
]


class Pool(enum.Enum):
    """Which kind of worker is being chosen."""

    AGGREGATED = "agg"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class ScoringWeights:
    """Credits per cached block by tier, and the selection temperature."""

    overlap_weight: float = 1.0
    host_weight: float = 0.75
    disk_weight: float = 0.25
    remote_weight: float = 0.1
    temperature: float = 0.0
    prefill_load_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in (
            "overlap_weight",
            "host_weight",
            "disk_weight",
            "remote_weight",
            "prefill_load_scale",
        ):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")


class TierOverlap:
    """Leading blocks of the request a worker holds, per tier (each counted from block 0).

    A plain class, not a dataclass: ``longest`` is read several times per request, so it is
    computed once here (a frozen dataclass would pay a call per read, and more per build)."""

    __slots__ = ("disk", "gpu", "host", "longest", "remote")

    def __init__(self, gpu: int = 0, host: int = 0, disk: int = 0, remote: int = 0) -> None:
        self.gpu = gpu
        self.host = host
        self.disk = disk
        self.remote = remote
        self.longest = max(gpu, host, disk, remote)

    def _tiers(self) -> tuple[int, int, int, int]:
        return (self.gpu, self.host, self.disk, self.remote)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TierOverlap) and self._tiers() == other._tiers()

    def __hash__(self) -> int:
        return hash(self._tiers())

    def __repr__(self) -> str:
        return "TierOverlap(gpu={}, host={}, disk={}, remote={})".format(*self._tiers())


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's in-flight load, as the gateway accounts it (``active_load.py``: its own
    count, plus what the engine's own reading holds beyond it when it publishes one)."""

    active_prefill_tokens: int = 0
    decode_blocks: int = 0  # blocks held by active requests, this request's included
    in_flight: int = 0
    capacity_blocks: int | None = None  # the worker's KV pool, when it reports one


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: str
    overlap: TierOverlap
    load: WorkerLoad


class Reason:
    """Why the scorer chose its worker, set against the deepest overlap on offer
    (``Placement.reason``; the policies that do not score overlap leave it ``""``)."""

    BEST = "best"  # the chosen worker holds the deepest overlap of any eligible worker
    TIE = "tie"  # as deep as any, and drawn at random among workers of equal cost and depth
    ONLY_CANDIDATE = "only_candidate"  # one eligible worker
    LOAD = "load"  # a deeper worker cost more for its queued prefill and held blocks
    TIER = "tier"  # the deeper match lies in a slower tier, credited less than a shallower one
    CAPACITY = "capacity"  # every deeper worker was full (in-flight cap, or no room to decode)
    SAMPLED = "sampled"  # --temperature drew a worker costlier than the cheapest
    AFFINITY = "affinity"  # the client's session (x-session-id) is pinned to the worker
    # a deeper worker would have won on prefill and held blocks, but one more stream there
    # slows its decoding more than the prefill saved (decode_price.py)
    INTERFERENCE = "interference"

    ALL = (BEST, TIE, ONLY_CANDIDATE, LOAD, TIER, CAPACITY, SAMPLED, AFFINITY, INTERFERENCE)


@dataclass(frozen=True, slots=True)
class Placement:
    """The chosen worker, its cost and the overlap predicted for it; for a scored placement
    also the deepest overlap (blocks, any tier) any eligible worker held, and ``reason``, why
    the chosen worker won (``Reason``; ``""`` when the policy does not score overlap)."""

    worker_id: str
    cost: float
    overlap: TierOverlap
    best_overlap: int = 0
    reason: str = ""


class Scorer:
    """Scores candidates for one request and picks one."""

    __slots__ = ("_rng", "block_size", "decode", "weights")

    def __init__(
        self, weights: ScoringWeights, block_size: int, rng: random.Random | None = None
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.weights = weights
        self.block_size = block_size
        self._rng = rng or random.Random()
        # The decode-interference price, set by its learner (interference.py); None: off.
        self.decode: DecodePrice | None = None

    def credit_blocks(self, overlap: TierOverlap) -> float:
        """Cached blocks credited against prefill, each at the fastest tier holding it."""
        w = self.weights
        covered = overlap.gpu
        credit = w.overlap_weight * covered
        for weight, depth in (
            (w.host_weight, overlap.host),
            (w.disk_weight, overlap.disk),
            (w.remote_weight, overlap.remote),
        ):
            if depth > covered:
                credit += weight * (depth - covered)
                covered = depth
        return credit

    def prefill_blocks_after_credit(self, candidate: Candidate, prompt_tokens: int) -> float:
        raw = (candidate.load.active_prefill_tokens + prompt_tokens) / self.block_size
        return raw - self.credit_blocks(candidate.overlap)  # unclamped: see the module doc

    def cost(self, candidate: Candidate, prompt_tokens: int, pool: Pool = Pool.AGGREGATED) -> float:
        """The cost of placing the request on ``candidate`` (lower is better)."""
        if pool is Pool.PREFILL:
            return self.prefill_blocks_after_credit(candidate, prompt_tokens)
        if pool is Pool.DECODE:
            capacity = candidate.load.capacity_blocks
            if not capacity:
                return float(candidate.load.decode_blocks)
            return candidate.load.decode_blocks / capacity
        cost = self.prefill_decode_cost(candidate, prompt_tokens)
        decode = self.decode
        if decode is not None:
            uncached = prompt_tokens - candidate.overlap.longest * self.block_size
            cost += decode.cost(candidate.worker_id, candidate.load.in_flight, uncached)
        return cost

    def prefill_decode_cost(self, candidate: Candidate, prompt_tokens: int) -> float:
        """The aggregated cost without the decode-interference term (Dynamo's)."""
        scale = self.weights.prefill_load_scale
        return scale * self.prefill_blocks_after_credit(candidate, prompt_tokens) + (
            candidate.load.decode_blocks
        )

    def place(
        self,
        candidates: Sequence[Candidate],
        prompt_tokens: int,
        pool: Pool = Pool.AGGREGATED,
        saturated: Sequence[Candidate] = (),
    ) -> Placement | None:
        """The chosen candidate, or None if there is none (or, for a decode pool, none has
        room for the request's blocks: the caller applies backpressure). ``saturated``: the
        workers at their in-flight cap, never chosen, whose overlap still counts as the
        deepest on offer (so a miss they cause reads ``capacity``)."""
        full = saturated
        if pool is Pool.DECODE:
            fits: list[Candidate] = []
            over = list(saturated)
            for c in candidates:
                capacity = c.load.capacity_blocks
                (fits if capacity is None or c.load.decode_blocks <= capacity else over).append(c)
            candidates, full = fits, over
        if not candidates:
            return None
        costs = [self.cost(c, prompt_tokens, pool) for c in candidates]
        tied = False
        if self.weights.temperature > 0:
            index = self._sample(costs)
        else:
            index, tied = self._argmin(candidates, costs)
        chosen = candidates[index]
        depth = chosen.overlap.longest
        best = max(c.overlap.longest for c in candidates)
        best_full = max((c.overlap.longest for c in full), default=0)
        if best_full > best:
            reason = Reason.CAPACITY
            best = best_full
        elif len(candidates) == 1:
            reason = Reason.ONLY_CANDIDATE
        elif depth >= best:
            reason = Reason.TIE if tied else Reason.BEST
        else:
            reason = self._why_shallower(candidates, costs, index, best, prompt_tokens)
        return Placement(chosen.worker_id, costs[index], chosen.overlap, best, reason)

    def _why_shallower(
        self,
        candidates: Sequence[Candidate],
        costs: list[float],
        index: int,
        best: int,
        prompt_tokens: int,
    ) -> str:
        """Why ``candidates[index]`` won over the cheapest of the deepest candidates."""
        if costs[index] > min(costs):
            return Reason.SAMPLED
        deepest = min(
            (i for i, c in enumerate(candidates) if c.overlap.longest == best),
            key=costs.__getitem__,
        )
        chosen_credit = self.credit_blocks(candidates[index].overlap)
        if self.credit_blocks(candidates[deepest].overlap) <= chosen_credit:
            return Reason.TIER
        if self.decode is not None and self.prefill_decode_cost(
            candidates[deepest], prompt_tokens
        ) <= self.prefill_decode_cost(candidates[index], prompt_tokens):
            return Reason.INTERFERENCE  # the deepest would have won without the decode term
        return Reason.LOAD

    def _argmin(self, candidates: Sequence[Candidate], costs: list[float]) -> tuple[int, bool]:
        """The cheapest candidate, and whether it was drawn at random among equals."""
        best = min(costs)
        tied = [i for i, c in enumerate(costs) if c == best]
        if len(tied) > 1:
            deepest = max(candidates[i].overlap.longest for i in tied)
            tied = [i for i in tied if candidates[i].overlap.longest == deepest]
        if len(tied) == 1:
            return tied[0], False
        return self._rng.choice(tied), True

    def _sample(self, costs: list[float]) -> int:
        low, high = min(costs), max(costs)
        if high == low:
            return self._rng.randrange(len(costs))
        span = high - low
        weights = [math.exp(-((c - low) / span) / self.weights.temperature) for c in costs]
        return self._rng.choices(range(len(costs)), weights=weights)[0]
