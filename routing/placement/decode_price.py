"""What one more stream costs a worker's decoding: the term that keeps a hot prefix from herding.

The rest of the cost (``scorer.py``) prices prefill: queued and uncached prompt blocks, less
the cached ones. A worker that holds a hot prefix then wins every request for it, whatever
it already decodes, because a cached block saves prefill once while the decode slowdown of
stacking streams on one worker never shows in the cost. This term prices that slowdown, in
seconds converted to the cost's units, from what the gateway has learned
(``interference.py``):

* ``ItlModel``: the worker's inter-token latency with ``n`` requests in flight,
  ``base + per_stream·n``;
* placing the request there adds, over the ``output_tokens`` a request streams on average,
  its own stream (``itl(n+1)`` per token) and the slowdown of the ``n`` streams already there
  (``per_stream`` per token each): ``output_tokens · (itl(n+1) + per_stream·n)`` seconds;
* its uncached prompt stalls those ``n`` streams while it is prefilled (a prefill step runs
  between decode steps): ``n · prefill_s_per_token · uncached_tokens`` seconds;
* goodput: when ``itl(n+1)`` exceeds the ITL target, the ``n+1`` streams each run that much
  over it for every token: ``output_tokens · (n+1) · (itl(n+1) − target)`` more seconds, so
  the penalty grows in proportion to how far, and how many, placement pushes past the target.
  The target is the request's own (``x-kvsidecar-slo-itl-ms``) where it names one, else the
  gateway's.

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
        """Decode seconds the fleet's streams lose if the request goes to ``worker_id``;
        ``itl_target_s``: the request's ITL target (None: the gateway's)."""
        m = self.workers.get(worker_id, self.fleet)
        n = in_flight
        itl = m.base_s + m.per_stream_s * (n + 1)
        lost = self.output_tokens * (itl + m.per_stream_s * n)
        if uncached_tokens > 0:
            lost += n * self.prefill_s_per_token * uncached_tokens
        over = itl - (self.itl_target_s if itl_target_s is None else itl_target_s)
        if over > 0:
            lost += self.output_tokens * (n + 1) * over
        return lost

    def cost(self, worker_id: str, in_flight: int, uncached_tokens: float,
             itl_target_s: float | None = None) -> float:
        """``seconds`` in the cost's units, times ``weight``."""
        return self.weight * self.units_per_s * self.seconds(
            worker_id, in_flight, uncached_tokens, itl_target_s)
