"""The scorer's weights from the fleet's own feedback, not from an operator's sweep.

Two weights decide placement (``scorer.py``): ``prefill_load_scale``, what a block of prefill
work costs against a block held by decoding requests, and ``overlap_weight``, what a cached
block is worth against a block of queued prefill. Each is learned from what the router sees:

* ``prefill_load_scale`` from time to first token. Every placement records the worker's
  prefill tokens (queued ahead plus the request's own uncached ones) and the blocks held by
  its decoding requests; its first token gives the TTFT. A least-squares fit, exponentially
  forgetting old samples, of ``ttft ≈ k + a·prefill_tokens + c·decode_blocks`` prices both in
  seconds, and ``a·block_size / c`` is the scale. Until enough samples, and while the fit
  is degenerate, the last value (at first the prior) stays.
* ``overlap_weight`` from the engines' events. A cached block saves one block of prefill now
  (weight 1). When a worker's pool is full it is worth more: a request sent away from the
  worker holding its prefix recomputes it elsewhere and evicts as many blocks there, which
  later requests miss, and scatters its conversation over copies nobody reuses. The share of
  stored blocks that the engines evict (``removed / stored``, forgetting old events) measures
  that pressure: 0 while every pool has room (the weight stays 1, Dynamo's default, and load
  balancing may copy prefixes freely), 1 when every store evicts (the weight reaches
  ``1 + LOCALITY``). ``LOCALITY`` is the middle of the plateau the offline sweep on the
  Mooncake conversation trace found (10 to 50, docs/bench/replay.md), a property of LRU
  caches under pressure rather than of one workload.

The same TTFT fit gives ``prefill_s_per_token`` (``a``), which the decode-interference term
(``interference.py``) needs to price decode seconds in the cost's units; with that term on,
TTFT samples are kept even when the scale is fixed.

An operator's ``--overlap-weight`` or ``--prefill-load-scale`` fixes that weight; the tuner
then learns only the other. Pure and synchronous: time comes in as arguments.
"""

from __future__ import annotations

import math
from dataclasses import replace

from routing.placement.scorer import Scorer

__all__ = ["LOCALITY", "WeightTuner"]

LOCALITY = 20.0  # overlap_weight − 1 at full eviction pressure
SCALE_PRIOR = 10.0  # prefill_load_scale until the fit has enough samples
SCALE_RANGE = (1.0, 1000.0)
_MIN_SAMPLES = 32  # TTFT samples before the fit is used
_FORGET = 0.995  # per TTFT sample: old placements weigh less as the traffic changes
_EVENT_FORGET = 0.9995  # per stored block: the pressure follows the last few thousand
_REFIT_EVERY = 8  # TTFT samples between refits (each refit sets the scorer's weights)
_PENDING_LIMIT = 65536  # placements awaiting a first token (aborted ones age out)


class WeightTuner:
    """Adapts a ``Scorer``'s overlap weight and prefill load scale to the fleet."""

    __slots__ = (
        "_fixed_overlap",
        "_fixed_scale",
        "_pending",
        "_removed",
        "_samples",
        "_scorer",
        "_stored",
        "_sums",
        "collects_ttft",
        "prefill_s_per_token",
        "scale",
    )

    def __init__(
        self,
        scorer: Scorer,
        *,
        fixed_overlap: float | None = None,
        fixed_scale: float | None = None,
        fit_ttft: bool = False,
    ) -> None:
        """``fit_ttft``: keep the TTFT fit even with a fixed scale (for its
        ``prefill_s_per_token``)."""
        self._scorer = scorer
        self._fixed_overlap = fixed_overlap
        self._fixed_scale = fixed_scale
        self.scale = SCALE_PRIOR if fixed_scale is None else fixed_scale
        # The fit's seconds per prefill token (the fleet's prefill speed), once it has one:
        # what a pull (``kv_move.py``) and decode interference (``decode_price.py``) are
        # priced against.
        self.prefill_s_per_token: float | None = None
        # Forgetting sums over TTFT samples, x = (1, prefill tokens p, decode blocks d):
        # n, Σp, Σd, Σp², Σpd, Σd², Σy, Σpy, Σdy.
        self._sums = [0.0] * 9
        self._samples = 0
        self._pending: dict[str, tuple[float, float, float]] = {}
        self._stored = 0.0
        self._removed = 0.0
        self.collects_ttft = fixed_scale is None or fit_ttft
        self._apply()

    @property
    def learns_scale(self) -> bool:
        return self._fixed_scale is None

    @property
    def pressure(self) -> float:
        """The share of stored blocks the engines evict (0: room everywhere, 1: full)."""
        return min(1.0, self._removed / self._stored) if self._stored else 0.0

    def overlap_weight(self) -> float:
        if self._fixed_overlap is not None:
            return self._fixed_overlap
        return 1.0 + LOCALITY * self.pressure

    # --- feedback -----------------------------------------------------------------------

    def dispatched(
        self, request_id: str, prefill_tokens: int, decode_blocks: int, now: float
    ) -> None:
        """A request was placed on a worker with this much prefill (queued ahead plus its
        own uncached tokens) and this many blocks held by decoding requests."""
        pending = self._pending
        if len(pending) >= _PENDING_LIMIT:
            del pending[next(iter(pending))]
        pending[request_id] = (now, float(prefill_tokens), float(decode_blocks))

    def first_token(self, request_id: str, now: float) -> None:
        """The request's first token arrived: one TTFT sample."""
        sample = self._pending.pop(request_id, None)
        if sample is None:
            return
        t0, p, d = sample
        y = now - t0
        s = self._sums
        for i in range(9):
            s[i] *= _FORGET
        s[0] += 1.0
        s[1] += p
        s[2] += d
        s[3] += p * p
        s[4] += p * d
        s[5] += d * d
        s[6] += y
        s[7] += p * y
        s[8] += d * y
        self._samples += 1
        if self._samples % _REFIT_EVERY == 0:
            self._refit()

    def forget(self, request_id: str) -> None:
        """The request ended without a first token."""
        self._pending.pop(request_id, None)

    def blocks_stored(self, count: int) -> None:
        """An engine stored ``count`` blocks (GPU tier)."""
        decay = _EVENT_FORGET**count
        self._stored = self._stored * decay + count
        self._removed *= decay

    def blocks_removed(self, count: int) -> None:
        """An engine evicted ``count`` blocks (GPU tier)."""
        self._removed += count

    # --- the fit ------------------------------------------------------------------------

    def _refit(self) -> None:
        if self._samples >= _MIN_SAMPLES:
            fit = self._fit()
            if fit is not None:
                a, c = fit
                self.prefill_s_per_token = a
                if self._fixed_scale is None:
                    low, high = SCALE_RANGE
                    block = self._scorer.block_size
                    fitted = high if c <= 0 else min(high, max(low, a * block / c))
                    # Halfway there in log space: one noisy window does not swing placement.
                    self.scale = math.sqrt(self.scale * fitted)
        self._apply()

    def _fit(self) -> tuple[float, float] | None:
        """``(a, c)`` of the least-squares fit; None if degenerate or ``a`` is not positive
        (the scale is then ``a·block_size / c``, clamped)."""
        n, sp, sd, spp, spd, sdd, sy, spy, sdy = self._sums
        # Centred normal equations for (a, c): the intercept k drops out.
        vpp = spp - sp * sp / n
        vpd = spd - sp * sd / n
        vdd = sdd - sd * sd / n
        cpy = spy - sp * sy / n
        cdy = sdy - sd * sy / n
        det = vpp * vdd - vpd * vpd
        if vpp <= 0 or vdd <= 0 or det <= 1e-12 * vpp * vdd:
            return None
        a = (cpy * vdd - cdy * vpd) / det
        c = (cdy * vpp - cpy * vpd) / det
        if a <= 0:
            return None  # prefill work did not show in TTFT: nothing to learn from
        return a, c

    def _apply(self) -> None:
        scorer = self._scorer
        weights = scorer.weights
        ow, ps = self.overlap_weight(), self.scale
        if weights.overlap_weight != ow or weights.prefill_load_scale != ps:
            scorer.weights = replace(weights, overlap_weight=ow, prefill_load_scale=ps)
