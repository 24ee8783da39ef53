"""Per-tenant rate limits: token buckets for requests per second and tokens per second.

Each bucket holds up to ``burst`` units and refills at ``rate`` per second. A request that
finds at least ``min(cost, burst)`` units is granted and takes its whole cost, which may
leave the bucket in debt: a request larger than the burst is never refused forever, it only
makes the next ones wait longer. A refused request learns how long until it would pass
(``retry-after``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from routing.pipeline.admission import SHED_HEADER, SHED_RATE_LIMIT

__all__ = ["RateLimits", "TenantBuckets", "TokenBucket", "retry_after_header"]


@dataclass(frozen=True, slots=True)
class RateLimits:
    """A tenant's limits; ``None``: that dimension is unlimited."""

    requests_per_s: float | None = None
    tokens_per_s: float | None = None
    burst_s: float = 1.0  # a full bucket holds this many seconds of its rate

    def __post_init__(self) -> None:
        for name in ("requests_per_s", "tokens_per_s"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not math.isfinite(self.burst_s) or self.burst_s <= 0:
            raise ValueError(f"burst_s must be a finite number > 0, got {self.burst_s!r}")


class TokenBucket:
    """``rate`` units per second, at most ``burst`` banked."""

    __slots__ = ("_last", "_level", "burst", "rate")

    def __init__(self, rate: float, burst: float, now: float | None = None) -> None:
        self.rate = rate
        self.burst = burst
        self._level = burst
        self._last = time.monotonic() if now is None else now

    def take(self, cost: float, now: float | None = None) -> float:
        """Take ``cost`` units: 0.0 when granted, else the seconds until it would be."""
        now = time.monotonic() if now is None else now
        level = min(self.burst, self._level + (now - self._last) * self.rate)
        self._last = now
        need = min(cost, self.burst)
        if level >= need:
            self._level = level - cost
            return 0.0
        self._level = level
        return (need - level) / self.rate


class TenantBuckets:
    """One tenant's two buckets (either may be absent)."""

    __slots__ = ("limits", "requests", "tokens")

    def __init__(self, limits: RateLimits) -> None:
        self.limits = limits
        burst = limits.burst_s
        rps, tps = limits.requests_per_s, limits.tokens_per_s
        self.requests = None if rps is None else TokenBucket(rps, max(1.0, rps * burst))
        self.tokens = None if tps is None else TokenBucket(tps, max(1.0, tps * burst))

    def take_request(self) -> float:
        return 0.0 if self.requests is None else self.requests.take(1.0)

    def take_tokens(self, tokens: int) -> float:
        return 0.0 if self.tokens is None else self.tokens.take(float(tokens))


def retry_after_header(wait_s: float) -> bytes:
    """``retry-after`` in whole seconds, rounded up, at least 1, and the refusal's reason."""
    return b"retry-after: %d\r\n%s: %s\r\n" % (max(1, math.ceil(wait_s)), SHED_HEADER,
                                               SHED_RATE_LIMIT)
