"""Placement cost and selection: which worker a request should go to.

The cost of placing a request on a worker, lowest wins (Dynamo's default "linear" selector,
``lib/kv-router/src/scheduling/selector/default.rs`` in Dynamo's repository)::

    prefill_blocks_after_credit = (active_prefill_tokens + prompt_tokens) / block_size
                                  − overlap_weight·gpu − Σ tier_weights[tier]·tier
    cost = prefill_load_scale × prefill_blocks_after_credit + decode_blocks

(the sum over the tiers below the GPU, ``kvcore.events.Tier``: host, disk, remote; each
tier's overlap and weight are indexed by its ``Tier``, so a new tier is a new member there
and a default weight here)

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
time its streams would run past their ITL target with one more request, in the same units;
without it (none learned yet, or ``--decode-interference-weight 0``) the cost is the formula
above. A worker whose KV pool the request would overfill (its active blocks, the request's
included, past the capacity it reports) gets no decode term: there the request waits for
memory, joining the batch only as another leaves it, so it lengthens the queue (priced by
the formula above), not the batch's steps.

Disaggregated pools score differently: the prefill pool by overlap and prefill load only,
the decode pool by how full each worker would be (decode blocks over capacity).
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvcore.events import Tier
from routing.config import DEFAULT_TIER_WEIGHTS
from routing.placement.decode_price import DecodePrice

__all__ = [
    "DEFAULT_TIER_WEIGHTS",
    "LOWER_TIERS",
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


LOWER_TIERS = tuple(tier for tier in Tier if tier is not Tier.GPU)  # fastest first
# Credit per cached block of each tier below the GPU (``DEFAULT_TIER_WEIGHTS``, imported
# above) in blocks of prefill work: the gateway's --<tier>-weight defaults, written once in
# ``RouterConfig`` (the GPU's is ``overlap_weight``, learned by default).


def _check_weight(name: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class ScoringWeights:
    """Credits per cached block by tier, and the selection temperature."""

    overlap_weight: float = 1.0  # the GPU tier's
    # Every tier below the GPU's (a read-only mapping by default: shared, never copied).
    tier_weights: Mapping[Tier, float] = field(default_factory=lambda: DEFAULT_TIER_WEIGHTS)
    temperature: float = 0.0
    prefill_load_scale: float = 1.0
    # (tier, weight) below the GPU, fastest first: what ``Scorer.credit_blocks`` walks.
    lower_credits: tuple[tuple[Tier, float], ...] = field(init=False, repr=False,
                                                          compare=False)

    def __post_init__(self) -> None:
        _check_weight("overlap_weight", self.overlap_weight)
        _check_weight("prefill_load_scale", self.prefill_load_scale)
        _check_weight("temperature", self.temperature)
        if set(self.tier_weights) != set(LOWER_TIERS):
            raise ValueError(
                "tier_weights must give a weight to each tier below the GPU "
                f"({', '.join(t.name.lower() for t in LOWER_TIERS)}), got "
                f"{', '.join(t.name.lower() for t in self.tier_weights) or 'none'}")
        for tier in LOWER_TIERS:
            _check_weight(f"{tier.name.lower()}_weight", self.tier_weights[tier])
        object.__setattr__(self, "lower_credits",
                           tuple((tier, self.tier_weights[tier]) for tier in LOWER_TIERS))


_NUM_TIERS = len(Tier)
_PAD = [(0,) * (_NUM_TIERS - n) for n in range(_NUM_TIERS + 1)]  # the depths not given


class TierOverlap:
    """Leading blocks of the request a worker holds, per tier (each counted from block 0):
    ``depths[tier]``, in ``Tier`` order, those not given 0.

    A plain class, not a dataclass: ``gpu`` and ``longest`` are read several times per
    request, so they are computed once here (a frozen dataclass would pay a call per read,
    and more per build)."""

    __slots__ = ("depths", "gpu", "longest")

    def __init__(self, *depths: int) -> None:
        n = len(depths)
        if n < _NUM_TIERS:
            depths += _PAD[n]
        elif n > _NUM_TIERS:
            raise ValueError(f"{n} tier depths for {_NUM_TIERS} tiers")
        self.depths = depths
        self.gpu = depths[0]  # Tier.GPU
        self.longest = max(depths)

    @classmethod
    def of(cls, depths: Mapping[Tier, int]) -> TierOverlap:
        """From each tier's depth (a tier not named holds nothing)."""
        return cls(*(depths.get(tier, 0) for tier in Tier))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TierOverlap) and self.depths == other.depths

    def __hash__(self) -> int:
        return hash(self.depths)

    def __repr__(self) -> str:
        inner = ", ".join(f"{t.name.lower()}={d}" for t, d in zip(Tier, self.depths, strict=True))
        return f"TierOverlap({inner})"


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
    MOVED = "moved"  # its sidecar pulls the prefix from a busier holder's store (kv_move.py)
    # a deeper worker would have won on prefill and held blocks, but one more stream there
    # slows its decoding more than the prefill saved (decode_price.py)
    INTERFERENCE = "interference"

    ALL = (BEST, TIE, ONLY_CANDIDATE, LOAD, TIER, CAPACITY, SAMPLED, AFFINITY, MOVED,
           INTERFERENCE)


@dataclass(frozen=True, slots=True)
class Placement:
    """The chosen worker, its cost and the overlap predicted for it; for a scored placement
    also the deepest overlap (blocks, any tier) any eligible worker held, and ``reason``, why
    the chosen worker won (``Reason``; ``""`` when the policy does not score overlap). A move
    (``Reason.MOVED``) names the worker whose store the prefix is pulled from; ``overlap``
    then counts the pulled blocks in its host tier."""

    worker_id: str
    cost: float
    overlap: TierOverlap
    best_overlap: int = 0
    reason: str = ""
    moved_from: str | None = None


class Scorer:
    """Scores candidates for one request and picks one."""

    __slots__ = ("_rng", "block_size", "decode", "decode_moves", "weights")

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
        # Placements the decode term moved: the chosen worker is not among the cheapest
        # without it. Wider than Reason.INTERFERENCE, which names only moves off a deeper
        # holder; this also counts a new prefix sent to another worker than the cost
        # without the term would have chosen, which decides where that prefix is cached.
        self.decode_moves = 0

    def credit_blocks(self, overlap: TierOverlap) -> float:
        """Cached blocks credited against prefill, each at the fastest tier holding it."""
        w = self.weights
        depths = overlap.depths
        covered = depths[0]
        credit = w.overlap_weight * covered
        for tier, weight in w.lower_credits:
            depth = depths[tier]
            if depth > covered:
                credit += weight * (depth - covered)
                covered = depth
        return credit

    def prefill_blocks_after_credit(self, candidate: Candidate, prompt_tokens: int) -> float:
        raw = (candidate.load.active_prefill_tokens + prompt_tokens) / self.block_size
        return raw - self.credit_blocks(candidate.overlap)  # unclamped: see the module doc

    def cost(self, candidate: Candidate, prompt_tokens: int, pool: Pool = Pool.AGGREGATED,
             itl_target_s: float | None = None) -> float:
        """The cost of placing the request on ``candidate`` (lower is better);
        ``itl_target_s``: the request's own ITL target, for the decode term."""
        if pool is Pool.PREFILL:
            return self.prefill_blocks_after_credit(candidate, prompt_tokens)
        if pool is Pool.DECODE:
            capacity = candidate.load.capacity_blocks
            if not capacity:
                return float(candidate.load.decode_blocks)
            return candidate.load.decode_blocks / capacity
        return self.prefill_decode_cost(candidate, prompt_tokens) + self._decode_cost(
            candidate, prompt_tokens, itl_target_s)

    def _decode_cost(self, candidate: Candidate, prompt_tokens: int,
                     itl_target_s: float | None) -> float:
        """The decode-interference term (0: none learned, or the request would overfill
        the worker's pool and queue for memory there, slowing no step)."""
        decode = self.decode
        if decode is None:
            return 0.0
        load = candidate.load
        capacity = load.capacity_blocks
        if capacity and load.decode_blocks > capacity:
            return 0.0
        uncached = prompt_tokens - candidate.overlap.longest * self.block_size
        return decode.cost(candidate.worker_id, load.in_flight, uncached, itl_target_s)

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
        itl_target_s: float | None = None,
    ) -> Placement | None:
        """The chosen candidate, or None if there is none (or, for a decode pool, none has
        room for the request's blocks: the caller applies backpressure). ``saturated``: the
        workers at their in-flight cap, never chosen, whose overlap still counts as the
        deepest on offer (so a miss they cause reads ``capacity``). ``itl_target_s``: the
        request's own ITL target (None: the gateway's)."""
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
        # With a decode term, each aggregated candidate's cost without it is kept: what the
        # term changed is read off it (a move, the reason ``interference``).
        base: list[float] | None = None
        if pool is Pool.AGGREGATED and self.decode is not None:
            base = [self.prefill_decode_cost(c, prompt_tokens) for c in candidates]
            costs = [b + self._decode_cost(c, prompt_tokens, itl_target_s)
                     for b, c in zip(base, candidates, strict=True)]
        else:
            costs = [self.cost(c, prompt_tokens, pool, itl_target_s) for c in candidates]
        tied = False
        if self.weights.temperature > 0:
            index = self._sample(costs)
        else:
            index, tied = self._argmin(candidates, costs)
            if base is not None and base[index] > min(base):
                self.decode_moves += 1
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
            reason = self._why_shallower(candidates, costs, index, best, base)
        return Placement(chosen.worker_id, costs[index], chosen.overlap, best, reason)

    def _why_shallower(
        self,
        candidates: Sequence[Candidate],
        costs: list[float],
        index: int,
        best: int,
        base: list[float] | None,
    ) -> str:
        """Why ``candidates[index]`` won over the cheapest of the deepest candidates
        (``base``: the costs without the decode term, when it priced them)."""
        if costs[index] > min(costs):
            return Reason.SAMPLED
        deepest = min(
            (i for i, c in enumerate(candidates) if c.overlap.longest == best),
            key=costs.__getitem__,
        )
        chosen_credit = self.credit_blocks(candidates[index].overlap)
        if self.credit_blocks(candidates[deepest].overlap) <= chosen_credit:
            return Reason.TIER
        if base is not None and base[deepest] <= base[index]:
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
