"""Per-policy figures from per-request results: hit rate, latency percentiles, load balance.

Definitions (used by the report, the benchmark and the live/offline comparison alike):

* **hit rate**: cached prompt tokens / prompt tokens, over requests that did not fail;
* **TTFT**, **e2e**: from arrival; **ITL**: every inter-token gap, pooled over requests;
* **load imbalance**: the busiest worker's prompt tokens to compute (uncached) over the mean;
  1.0 is perfect balance;
* **predicted-vs-actual gap**: Σ |predicted − actual| cached tokens over requests, as a share
  of all prompt tokens (how far the router's view was from what the engines found).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PolicySummary", "RequestOutcome", "summarize", "weighted_percentile"]


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """What one request did, offline or live (times in seconds; NaN when unknown)."""

    index: int
    worker: str
    input_tokens: int
    output_tokens: int
    predicted_tokens: int
    cached_tokens: int
    ttft: float
    itl_mean: float
    e2e: float
    error: str | None = None


@dataclass(frozen=True, slots=True)
class PolicySummary:
    policy: str
    requests: int
    errors: int
    hit_rate: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    e2e_p50: float
    load_imbalance: float
    predicted_gap: float

    def row(self) -> dict[str, float | int | str]:
        return {
            "policy": self.policy,
            "requests": self.requests,
            "errors": self.errors,
            "hit_rate": self.hit_rate,
            "ttft_p50_s": self.ttft_p50,
            "ttft_p99_s": self.ttft_p99,
            "itl_p50_ms": self.itl_p50 * 1e3,
            "itl_p99_ms": self.itl_p99 * 1e3,
            "e2e_p50_s": self.e2e_p50,
            "load_imbalance": self.load_imbalance,
            "predicted_gap": self.predicted_gap,
        }


def weighted_percentile(values: Sequence[float], weights: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` each counted ``weights`` times."""
    if not len(values):
        return math.nan
    v = np.asarray(values, dtype=float)
    w = np.asarray(weights, dtype=float)
    order = np.argsort(v)
    v, w = v[order], w[order]
    cum = np.cumsum(w)
    target = q / 100.0 * cum[-1]
    return float(v[min(int(np.searchsorted(cum, target)), len(v) - 1)])


def _pct(values: list[float], q: float) -> float:
    finite = [x for x in values if math.isfinite(x)]
    return float(np.percentile(finite, q)) if finite else math.nan


def summarize(
    policy: str,
    outcomes: Sequence[RequestOutcome],
    itl_samples: Sequence[tuple[float, float]] | None = None,
    predicts: bool = True,
) -> PolicySummary:
    """Figures for one policy; ``itl_samples`` (gap, weight) default to per-request means;
    ``predicts``: False for policies that never look at prefixes (their gap is NaN)."""
    ok = [o for o in outcomes if o.error is None]
    prompt = sum(o.input_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    if itl_samples:
        gaps, weights = zip(*itl_samples, strict=True)
    else:
        pairs = [(o.itl_mean, 1.0) for o in ok if math.isfinite(o.itl_mean)]
        gaps, weights = zip(*pairs, strict=True) if pairs else ((), ())
    per_worker: dict[str, int] = {}
    for o in ok:
        per_worker[o.worker] = per_worker.get(o.worker, 0) + o.input_tokens - o.cached_tokens
    loads = list(per_worker.values())
    mean_load = sum(loads) / len(loads) if loads else 0.0
    gap = sum(abs(o.predicted_tokens - o.cached_tokens) for o in ok)
    return PolicySummary(
        policy=policy,
        requests=len(outcomes),
        errors=len(outcomes) - len(ok),
        hit_rate=cached / prompt if prompt else 0.0,
        ttft_p50=_pct([o.ttft for o in ok], 50),
        ttft_p99=_pct([o.ttft for o in ok], 99),
        itl_p50=weighted_percentile(gaps, weights, 50),
        itl_p99=weighted_percentile(gaps, weights, 99),
        e2e_p50=_pct([o.e2e for o in ok], 50),
        load_imbalance=max(loads) / mean_load if mean_load else 1.0,
        predicted_gap=gap / prompt if prompt and predicts else math.nan,
    )
