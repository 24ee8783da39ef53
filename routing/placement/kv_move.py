"""Moving a prefix instead of herding onto its holder: the pull option in the cost model.

When a few prefixes are hot, the workers holding them take every request that shares them:
a cached prefix is worth more than their queue, and the others stay idle (issue 32). A
worker whose sidecar can *pull* the prefix from the holder's block store before prefill
(``sidecar.kv_move``: shm on one host, NIXL or TCP across hosts) has it nearly as cheaply.
So each worker is offered the prefix the deepest other worker's store holds (the ``host``
tier the sidecars publish: what a pull can fetch), at the pull's price:

* the pulled blocks are credited as blocks of the worker's own host tier (where the pull
  puts them, and where its engine loads them from), at the scorer's ``host_weight``;
* the pull's time is charged as prefill work: ``ratio`` × the pulled tokens, ``ratio`` being
  the pull's seconds per block over the seconds per block a prefill takes.

The scorer then weighs the holder's queue against a lighter worker's pull like any other
cost (``KvRouter.place``); a placement it takes for a pull is a *move*: its reason is
``moved``, and it names the source the worker's sidecar pulls from.

The ratio is learned online. The pull's seconds per block come from every moved request's
answer (its sidecar reports the pull's blocks, bytes and seconds: ``x-kvsidecar-kv-pull``);
a prefill's seconds per token from the TTFT fit (``WeightTuner.prefill_s_per_token``).
Until both are known, ``RATIO_PRIOR``: a pull over shared memory or RDMA moves a block in a
small fraction of the time a prefill computes it. A ratio of 1 or more (pulling is no faster
than computing) offers no move at all.

A pull that fails is a recompute (the engine prefills the whole prompt), never an error; the
source is then not offered again for ``backoff_s``, so a holder whose sidecar went away does
not turn every request into a failed pull.

The shared Redis tier needs no move: a prefix there is in every connected worker's
``remote`` tier already and its engine loads it through the same hook; the scorer credits
it (``remote_weight``).

Pure and synchronous, clock injected.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvcore.events import Tier
from routing.placement.scorer import Candidate, TierOverlap

__all__ = ["RATIO_PRIOR", "MovePlan", "MovePlanner", "PullReport", "parse_pull"]

RATIO_PRIOR = 0.1  # a pull's seconds per block over a prefill's, until both are measured
_FORGET = 0.9  # per pull report: the rate follows the last ten or so pulls


@dataclass(frozen=True, slots=True)
class MovePlan:
    """Pull the prompt's first ``blocks`` blocks from ``source_id``'s store."""

    source_id: str
    blocks: int


@dataclass(frozen=True, slots=True)
class PullReport:
    """What a worker's sidecar said of one pull (``x-kvsidecar-kv-pull``)."""

    ok: bool
    blocks: int
    num_bytes: int
    seconds: float
    error: str = ""


def parse_pull(value: bytes) -> PullReport | None:
    """``outcome=ok blocks=12 bytes=393216 seconds=0.003100`` (or ``outcome=failed:CODE``)
    as a report; None when it is not one (an older sidecar, a garbled header)."""
    fields: dict[str, str] = {}
    for part in value.decode("latin-1").split():
        name, sep, field = part.partition("=")
        if sep:
            fields[name] = field
    outcome = fields.get("outcome")
    try:
        blocks, num_bytes = int(fields["blocks"]), int(fields["bytes"])
        seconds = float(fields["seconds"])
    except (KeyError, ValueError):
        return None
    if outcome is None or not math.isfinite(seconds) or seconds < 0:
        return None
    if outcome == "ok":
        return PullReport(True, blocks, num_bytes, seconds)
    return PullReport(False, blocks, num_bytes, seconds, outcome.removeprefix("failed:"))


class MovePlanner:
    """Offers each worker the prefix another worker's store holds, at the pull's price."""

    __slots__ = ("_backoff", "_clock", "_has_store", "_prefill_s_per_token", "_s_per_block",
                 "_weight",
                 "backoff_s", "block_size", "num_bytes", "num_failed", "num_moved",
                 "num_planned", "seconds")

    def __init__(
        self,
        block_size: int,
        *,
        prefill_s_per_token: Callable[[], float | None] = lambda: None,
        has_store: Callable[[str], bool] = lambda worker_id: True,
        backoff_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``prefill_s_per_token``: the fleet's prefill speed, once known (the tuner's);
        ``has_store``: whether a worker's sidecar has a block store to pull into (one that
        has published host-tier blocks)."""
        if backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {backoff_s}")
        self.block_size = block_size
        self.backoff_s = backoff_s
        self._prefill_s_per_token = prefill_s_per_token
        self._has_store = has_store
        self._clock = clock
        self._backoff: dict[str, float] = {}  # source worker → not offered until then
        # Forgetting sums of the pulls reported: seconds, and blocks (their ratio: s/block).
        self._s_per_block = 0.0
        self._weight = 0.0
        self.num_planned = 0  # placements the pull won
        self.num_moved = 0  # pulls reported done
        self.num_failed = 0  # pulls reported failed (the request recomputed)
        self.num_bytes = 0  # bytes the reported pulls moved, and their seconds
        self.seconds = 0.0

    # --- the price ------------------------------------------------------------------------

    def pull_s_per_block(self) -> float | None:
        """The pulls' measured seconds per block (None before the first report)."""
        return self._s_per_block / self._weight if self._weight else None

    def gbytes_per_s(self) -> float | None:
        """The pulls' measured throughput, all reports together (for the operator)."""
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else None

    def ratio(self) -> float:
        """A pulled block's time over a prefilled block's: the share of a recompute a
        pull costs."""
        pull = self.pull_s_per_block()
        prefill = self._prefill_s_per_token()
        if pull is None or prefill is None or prefill <= 0:
            return RATIO_PRIOR
        return pull / (prefill * self.block_size)

    # --- the offer ------------------------------------------------------------------------

    def offer(
        self, candidates: Sequence[Candidate], sources: Sequence[Candidate],
        stored: Sequence[int] | None = None,
    ) -> tuple[list[Candidate], dict[str, MovePlan]]:
        """``candidates`` with the pull credited where it adds to what a worker holds, and
        the plan behind each such credit, by worker. ``sources``: every worker whose store
        may serve the pull (the candidates and the workers too busy to be chosen).
        ``stored``: per candidate, the leading blocks it really holds (any tier), without
        those only predicted there by placements in flight (None: its overlap). A worker
        predicted to hold the prefix because a move to it is in flight is credited as it
        is, and told to pull all the same: its sidecar joins that pull rather than let the
        engine start before the blocks are there."""
        ratio = self.ratio()
        if ratio >= 1.0 or len(sources) < 2:
            return list(candidates), {}
        now = self._clock()
        source: Candidate | None = None
        deepest = 0
        for c in sources:
            held = c.overlap.depths[Tier.HOST]
            if held > deepest and self._backoff.get(c.worker_id, 0.0) <= now:
                source, deepest = c, held
        if source is None:
            return list(candidates), {}
        depth = source.overlap.depths[Tier.HOST]
        out: list[Candidate] = []
        plans: dict[str, MovePlan] = {}
        for i, c in enumerate(candidates):
            held = c.overlap.longest if stored is None else stored[i]
            if (c.worker_id == source.worker_id or held >= depth
                    or not self._has_store(c.worker_id)):
                out.append(c)
                continue
            plans[c.worker_id] = MovePlan(source.worker_id, depth)
            predicted = c.overlap.longest
            if predicted >= depth:
                out.append(c)  # credited already, as the blocks a move in flight brings
                continue
            depths = list(c.overlap.depths)
            depths[Tier.HOST] = depth
            out.append(Candidate(
                c.worker_id,
                TierOverlap(*depths),
                replace(c.load, active_prefill_tokens=c.load.active_prefill_tokens
                        + round((depth - predicted) * self.block_size * ratio))))
        return out, plans

    # --- feedback -------------------------------------------------------------------------

    def planned(self) -> None:
        self.num_planned += 1

    def reported(self, source_id: str, report: PullReport) -> None:
        """A moved request's sidecar said how its pull from ``source_id`` went."""
        if not report.ok:
            self.num_failed += 1
            self._backoff[source_id] = self._clock() + self.backoff_s
            return
        self.num_moved += 1
        self._backoff.pop(source_id, None)
        if report.blocks > 0:  # not a request that joined another's pull
            self.num_bytes += report.num_bytes
            self.seconds += report.seconds
            self._s_per_block = self._s_per_block * _FORGET + report.seconds
            self._weight = self._weight * _FORGET + report.blocks
