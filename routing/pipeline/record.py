"""One record per request: what each stage learned, and what the finish makes of it.

The stages fill the record as the request goes (its prompt at prepare, its placement at
place, its first and last byte and the stream's events at relay); the response headers are
read off it, and ``finish`` turns it into the metrics and the one canonical log line, for an
aggregated request and a prefill/decode pair alike.
"""

from __future__ import annotations

import time

import structlog

from routing.metrics import GatewayMetrics
from routing.pipeline.slo import Slo, judge
from routing.placement.scorer import Placement

__all__ = ["RequestRecord"]

_HEADERS = b"x-request-id: %s\r\nx-kvsidecar-worker: %s\r\nx-kvsidecar-cached-blocks: %d\r\n"
# A scored placement (kv, approx) also says what was achievable and why it was not reached.
_SCORED = b"x-kvsidecar-best-overlap-blocks: %d\r\nx-kvsidecar-placement-reason: %s\r\n"

log = structlog.get_logger("routing.pipeline", component="gateway")


class RequestRecord:
    """The facts of one request."""

    __slots__ = (
        "endpoint",
        "events",
        "key",
        "migrations",
        "placement",
        "prompt_tokens",
        "reported_cached",
        "request_id",
        "retries",
        "slo",
        "status",
        "t_first",
        "t_last",
        "t_start",
        "worker_ids",
    )

    def __init__(
        self, key: str, request_id: bytes, endpoint: str, prompt_tokens: int, t_start: float
    ) -> None:
        self.key = key  # unique in this gateway: the request's load accounting key
        self.request_id = request_id
        self.endpoint = endpoint
        self.prompt_tokens = prompt_tokens
        self.t_start = t_start
        # Where the prompt is served: the worker (aggregated) or the prefill worker (a pair).
        self.placement: Placement | None = None
        self.worker_ids: tuple[str, ...] = ()  # every worker that serves it, prefill first
        self.retries = 0
        self.migrations = 0  # times its stream went on on another worker
        self.status = 0
        self.reported_cached = -1  # cached tokens in the engine's usage (-1: none seen)
        self.events = 0  # SSE events relayed
        self.t_first = 0.0
        self.t_last = 0.0
        self.slo: Slo | None = None  # its targets, judged at finish (None: not judged)

    @property
    def worker_id(self) -> str:
        """The worker credited with the request (the prompt's), or ""."""
        return "" if self.placement is None else self.placement.worker_id

    def headers(self) -> bytes:
        """The response headers the gateway adds: request id, workers, cached blocks (and,
        for a scored placement, the best overlap on offer and the reason for the choice)."""
        placement = self.placement
        cached = 0 if placement is None else placement.overlap.longest
        ids = self.worker_ids
        workers = ids[0] if len(ids) == 1 else ",".join(ids)
        out = _HEADERS % (self.request_id, workers.encode(), cached)
        if placement is not None and placement.reason:
            out += _SCORED % (placement.best_overlap, placement.reason.encode())
        return out

    def finish(
        self, status: int, metrics: GatewayMetrics, block_size: int, log_line: bool
    ) -> None:
        """The request ended with ``status``: count it, and log it when ``log_line``."""
        self.status = status
        now = time.monotonic()
        metrics.count_response(self.endpoint, status)
        metrics.latency.observe(now - self.t_start)
        placement = self.placement
        if placement is not None and status < 500:
            wid = placement.worker_id
            metrics.worker_requests[wid] = metrics.worker_requests.get(wid, 0) + 1
            tokens = metrics.worker_prompt_tokens
            tokens[wid] = tokens.get(wid, 0) + self.prompt_tokens
            depth = placement.overlap.longest
            predicted = 0
            if depth:
                predicted = min(self.prompt_tokens, depth * block_size)
                metrics.predicted_cached_tokens += predicted
                table = metrics.worker_predicted_cached_tokens
                table[wid] = table.get(wid, 0) + predicted
            if placement.reason:  # a scored placement (kv, approx): it made a prediction
                _count_scored(metrics, placement.reason, placement.best_overlap, depth)
                if self.reported_cached >= 0:
                    _count_prediction(metrics, wid, predicted, self.reported_cached)
        itl: float | None = None
        if self.events:
            metrics.completion_tokens += self.events
            if self.events > 1:
                itl = (self.t_last - self.t_first) / (self.events - 1)
                metrics.itl.observe(itl)
        if self.slo is not None and status < 400 and self.t_first:
            outcome = judge(self.slo, self.t_first - self.t_start, itl)
            metrics.goodput[outcome] = metrics.goodput.get(outcome, 0) + 1
        if log_line:
            scored = placement if placement is not None and placement.reason else None
            log.debug(
                "request_completed",
                request_id=self.request_id.decode(errors="replace"),
                endpoint=self.endpoint,
                status=status,
                worker_id=",".join(self.worker_ids) or None,
                cached_blocks=None if placement is None else placement.overlap.longest,
                best_overlap_blocks=None if scored is None else scored.best_overlap,
                placement_reason=None if scored is None else scored.reason,
                reported_cached_tokens=None if self.reported_cached < 0 else self.reported_cached,
                prompt_tokens=self.prompt_tokens,
                events=self.events,
                retries=self.retries,
                migrations=self.migrations,
                latency_ms=round((now - self.t_start) * 1e3, 3),
                ttft_ms=round((self.t_first - self.t_start) * 1e3, 3) if self.t_first else None,
            )


def _count_scored(metrics: GatewayMetrics, reason: str, best: int, chosen: int) -> None:
    """Achieved (``chosen``) against achievable (``best``) overlap blocks, and the reason."""
    reasons = metrics.placement_reasons
    reasons[reason] = reasons.get(reason, 0) + 1
    metrics.best_overlap_blocks += best
    metrics.chosen_overlap_blocks += chosen
    metrics.missed_overlap.observe(best - chosen)


def _count_prediction(metrics: GatewayMetrics, wid: str, predicted: int, reported: int) -> None:
    """The cached tokens predicted at placement against those the engine reported."""
    checks = metrics.worker_prediction_checks
    checks[wid] = checks.get(wid, 0) + 1
    if predicted > reported:
        table = metrics.worker_overpredicted_tokens
        table[wid] = table.get(wid, 0) + predicted - reported
    elif reported > predicted:
        table = metrics.worker_underpredicted_tokens
        table[wid] = table.get(wid, 0) + reported - predicted
