"""Decode interference, learned online from the streams the gateway relays.

Every relayed stream tells the gateway how far apart its tokens come (``ActiveLoad`` reports
each gap with the worker's requests in flight at the time: ``TokenObserver``). Per worker, a
least-squares fit that forgets old samples, ``gap ≈ base + per_stream·in_flight``, says what
one more stream does to that worker's batch. A worker whose own samples do not spread over
enough batch sizes to fit a slope takes the fleet's slope (the slope all workers share, each
about its own mean; the slope across workers when each stays at one batch size) through its
own mean; a worker with no samples takes the fleet's line through every sample's mean.
Finished requests give the mean output length; the TTFT fit (``tuning.py``) gives the
seconds a prompt token costs to prefill, the exchange rate between decode seconds and the
cost's units.

Every ``_REFIT_EVERY`` samples the scorer gets a fresh ``DecodePrice`` (``decode_price.py``).
Nothing is learned from TTFT alone: until gaps have been seen, the scorer has no decode term.
Pure and synchronous: time comes from the injected clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from routing.placement.decode_price import DecodePrice, ItlModel
from routing.placement.scorer import Scorer
from routing.placement.tuning import WeightTuner

__all__ = ["DecodeInterference"]

_FORGET = 0.999  # per token: a worker's fit follows its last few thousand tokens
_OUTPUT_FORGET = 0.99  # per finished request: the mean output length follows the last hundred
_MIN_WEIGHT = 32.0  # tokens before a worker's (or the fleet's) fit is used
_MIN_SPREAD = 0.25  # variance of in-flight counts (requests²) a slope needs
_REFIT_EVERY = 64  # samples between refits
_MAX_GAP_S = 10.0  # a longer gap is a stalled stream, not a batch's pace


class _Fit:
    """Forgetting sums of (x = in flight, y = gap), weighted by tokens."""

    __slots__ = ("n", "sx", "sxx", "sxy", "sy")

    def __init__(self) -> None:
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, w: float, wx: float, wy: float, wxx: float, wxy: float,
            forget: float) -> None:
        """Forget a little, then add one sample of weight ``w`` given as its weighted terms
        (``w·x``, ``w·y``, ``w·x·x``, ``w·x·y``: computed once for the worker's fit and the
        fleet's, on every chunk a stream relays)."""
        self.n = self.n * forget + w
        self.sx = self.sx * forget + wx
        self.sy = self.sy * forget + wy
        self.sxx = self.sxx * forget + wxx
        self.sxy = self.sxy * forget + wxy

    def slope(self) -> float | None:
        """Seconds per request in flight; None if the samples do not spread enough."""
        n = self.n
        if n < _MIN_WEIGHT:
            return None
        var = self.sxx / n - (self.sx / n) ** 2
        if var < _MIN_SPREAD:
            return None
        return max(0.0, (self.sxy / n - self.sx * self.sy / (n * n)) / var)

    def through_mean(self, slope: float) -> ItlModel | None:
        """The line of ``slope`` through this fit's mean; None with too few samples."""
        n = self.n
        if n < _MIN_WEIGHT:
            return None
        return ItlModel(max(0.0, (self.sy - slope * self.sx) / n), slope)


class DecodeInterference:
    """Learns each worker's ITL against its load and prices one more stream for the scorer."""

    __slots__ = (
        "_fleet",
        "_output_n",
        "_output_sum",
        "_samples",
        "_scorer",
        "_tuner",
        "_workers",
        "clock",
        "itl_target_s",
        "weight",
    )

    def __init__(
        self,
        scorer: Scorer,
        tuner: WeightTuner,
        *,
        itl_target_s: float,
        weight: float = 1.0,
        clock: Callable[[], float],
    ) -> None:
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"decode interference weight must be >= 0, got {weight!r}")
        self._scorer = scorer
        self._tuner = tuner
        self.clock = clock  # TokenObserver's
        self.itl_target_s = itl_target_s
        self.weight = weight
        self._fleet = _Fit()
        self._workers: dict[str, _Fit] = {}
        self._output_n = 0.0
        self._output_sum = 0.0
        self._samples = 0

    # --- TokenObserver (active_load.py) ---------------------------------------------------

    def token_gap(self, worker_id: str, in_flight: int, gap_s: float, tokens: int) -> None:
        if not 0 <= gap_s <= _MAX_GAP_S:
            return
        fit = self._workers.get(worker_id)
        if fit is None:
            fit = self._workers[worker_id] = _Fit()
        forget = _FORGET if tokens == 1 else _FORGET**tokens  # one token a chunk, mostly
        # The sample's terms as floats: float arithmetic is cheaper than int or mixed, and
        # exact here (small integers), so the sums are the same to the bit.
        w = float(tokens)
        wx = w * in_flight
        wy = w * gap_s
        wxx, wxy = wx * in_flight, wx * gap_s
        fit.add(w, wx, wy, wxx, wxy, forget)
        self._fleet.add(w, wx, wy, wxx, wxy, forget)
        self._samples += 1
        if self._samples % _REFIT_EVERY == 0:
            self.refit()

    def finished(self, output_tokens: int) -> None:
        self._output_n = self._output_n * _OUTPUT_FORGET + 1.0
        self._output_sum = self._output_sum * _OUTPUT_FORGET + output_tokens

    def forget_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    # --- the fit ------------------------------------------------------------------------

    def models(self) -> tuple[ItlModel | None, dict[str, ItlModel]]:
        """The fleet's model and each worker's, as fitted now (None: no fleet fit yet)."""
        fleet_slope = self._common_slope()
        if fleet_slope is None:  # each worker at one batch size: compare the workers
            fleet_slope = self._fleet.slope()
            if fleet_slope is None:
                return None, {}
        fleet = self._fleet.through_mean(fleet_slope)
        workers: dict[str, ItlModel] = {}
        for worker_id, fit in self._workers.items():
            slope = fit.slope()
            model = fit.through_mean(fleet_slope if slope is None else slope)
            if model is not None:
                workers[worker_id] = model
        return fleet, workers

    def _common_slope(self) -> float | None:
        """The slope every worker shares, each about its own mean (so workers that differ
        in level but not in slope do not bend it); None if the batch sizes barely vary."""
        cov = var = n = 0.0
        for fit in self._workers.values():
            if fit.n <= 0:
                continue
            cov += fit.sxy - fit.sx * fit.sy / fit.n
            var += fit.sxx - fit.sx * fit.sx / fit.n
            n += fit.n
        if n < _MIN_WEIGHT or var < _MIN_SPREAD * n:
            return None
        return max(0.0, cov / var)

    def price(self) -> DecodePrice | None:
        """The price from the fits now; None until there are gaps, a TTFT fit and outputs."""
        if self.weight == 0 or not self._output_n:
            return None
        per_token = self._tuner.prefill_s_per_token
        if per_token is None:
            return None
        fleet, workers = self.models()
        if fleet is None:
            return None
        scorer = self._scorer
        units_per_s = scorer.weights.prefill_load_scale / (scorer.block_size * per_token)
        return DecodePrice(
            fleet=fleet,
            output_tokens=self._output_sum / self._output_n,
            prefill_s_per_token=per_token,
            units_per_s=units_per_s,
            itl_target_s=self.itl_target_s,
            weight=self.weight,
            workers=workers,
        )

    def refit(self) -> None:
        """Give the scorer the price the fits say now."""
        self._scorer.decode = self.price()
