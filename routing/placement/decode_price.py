"""What one more stream costs a worker's decoding: the term that keeps a hot prefix from herding.

The rest of the cost (``scorer.py``) prices prefill: queued and uncached prompt blocks, less
the cached ones. A worker that holds a hot prefix then wins every request for it, whatever
it already decodes, because a cached block saves prefill once while the decode slowdown of
stacking streams on one worker never shows in the cost. This term prices that slowdown, in
seconds converted to the cost's units, from what the gateway has learned
(``interference.py``):

* ``ItlModel``: the worker's inter-token latency with ``n`` requests in flight,
  ``base + per_stream·n``;
* placing the request there gives the worker's streams a mean ITL of ``itl(n+1)`` plus the
  stall of its uncached prompt (a prefill step runs between decode steps, so every stream
  there waits ``prefill_s_per_token · uncached_tokens`` once), spread over the
  ``output_tokens`` a request streams on average;
* only the part of that ITL past the target is priced (goodput: a stream within its ITL
  target loses nothing users are promised): ``over = mean ITL − target``, charged for every
  token still to come on the worker, the request's own ``output_tokens`` and, for each of
  the ``n`` streams already there, half of theirs (a stream in flight is on average halfway
  through): ``over · output_tokens · (1 + n/2)`` seconds. The price is 0 while the target
  holds, and grows with how far, and how many, placement pushes past it. The target is the
  request's own (``x-kvsidecar-slo-itl-ms``) where it names one, else the gateway's.

Why not the whole slowdown: the first cut charged every stream's slowdown below the target
too (``output_tokens · (itl(n+1) + per_stream·n)``, plus the stall for all ``n`` streams at
the TTFT fit's per-token rate, which includes queueing: 17× the engine's prefill rate on
the pressure load). Those seconds of decode nobody misses outweighed a cached system prompt,
so under memory pressure (``scripts/bench_pressure.py``, 1,024 blocks a worker) requests
went where their prefix was not and evicted other prefixes there: 14 points of hit rate and
twice the TTFT p99 (docs/bench/pressure.md, "The decode-interference term").

Seconds become cost units at the rate the prefill term already uses: a block of prefill
costs ``prefill_load_scale`` units and takes ``block_size · prefill_s_per_token`` seconds.
Without a fit (no samples yet) there is no price and the cost is the prefill-only model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DecodePrice", "ItlModel"]


@dataclass(frozen=True, slots=True)
class ItlModel:
    """A worker's inter-token latency against its requests in flight: ``base + per_stream·n``."""

    base_s: float
    per_stream_s: float

    def itl(self, streams: int) -> float:
        return self.base_s + self.per_stream_s * streams


@dataclass(frozen=True, slots=True)
class DecodePrice:
    """The learned parameters the scorer prices decode interference with (``weight`` 0: off)."""

    fleet: ItlModel  # for a worker with no samples of its own yet
    output_tokens: float  # mean tokens a request streams
    prefill_s_per_token: float  # seconds of prefill per uncached prompt token (the TTFT fit)
    units_per_s: float  # cost units per second: prefill_load_scale / (block_size · above)
    itl_target_s: float  # the gateway's ITL target (--slo-itl-ms)
    weight: float = 1.0  # --decode-interference-weight
    workers: dict[str, ItlModel] = field(default_factory=dict)

    def model(self, worker_id: str) -> ItlModel:
        return self.workers.get(worker_id, self.fleet)

    def seconds(self, worker_id: str, in_flight: int, uncached_tokens: float,
                itl_target_s: float | None = None) -> float:
        """Seconds past the ITL target the worker's streams run if the request goes to
        ``worker_id`` (0 while its target holds);
        ``itl_target_s``: the request's ITL target (None: the gateway's)."""
        m = self.workers.get(worker_id, self.fleet)
        n = in_flight
        tokens = max(self.output_tokens, 1.0)
        itl = m.base_s + m.per_stream_s * (n + 1)
        if uncached_tokens > 0:
            itl += self.prefill_s_per_token * uncached_tokens / tokens
        over = itl - (self.itl_target_s if itl_target_s is None else itl_target_s)
        if over <= 0:
            return 0.0
        return over * tokens * (1.0 + n / 2)

    def cost(self, worker_id: str, in_flight: int, uncached_tokens: float,
             itl_target_s: float | None = None) -> float:
        """``seconds`` in the cost's units, times ``weight``."""
        return self.weight * self.units_per_s * self.seconds(
            worker_id, in_flight, uncached_tokens, itl_target_s)
