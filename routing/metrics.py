"""Gateway metrics: plain counters on the hot path, rendered for Prometheus on scrape.

Recording a request costs a few dict and list increments (no locks, no label lookups through
``prometheus_client``); a custom collector turns them into metric families when ``/metrics``
is read.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

__all__ = ["GatewayMetrics", "Histogram"]

_LATENCY_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_PLACEMENT_BUCKETS_S = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.05,
)
_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class Histogram:
    """Cumulative-on-render histogram: ``observe`` is a bisect and two adds."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            acc += count
            out.append((repr(bound), acc))
        out.append(("+Inf", acc + self.counts[-1]))
        return out


class GatewayMetrics:
    """Everything the gateway counts."""

    def __init__(self) -> None:
        self.responses: dict[tuple[str, int], int] = {}  # (endpoint, status) → count
        self.worker_requests: dict[str, int] = {}
        self.worker_prompt_tokens: dict[str, int] = {}  # as the gateway counted them
        self.worker_predicted_cached_tokens: dict[str, int] = {}
        self.worker_actual_cached_tokens: dict[str, int] = {}  # from the engines' usage
        # Achieved vs achievable (scored placements: kv, approx) and the prediction checked
        # against the engine's usage, per request that carried one (see record.finish).
        self.placement_reasons: dict[str, int] = {}  # scorer.Reason → count
        self.best_overlap_blocks = 0
        self.chosen_overlap_blocks = 0
        self.missed_overlap = Histogram(_BLOCK_BUCKETS)  # best − chosen, blocks
        self.worker_usage_prompt_tokens: dict[str, int] = {}
        self.worker_prediction_checks: dict[str, int] = {}
        self.worker_overpredicted_tokens: dict[str, int] = {}
        self.worker_underpredicted_tokens: dict[str, int] = {}
        self.worker_errors: dict[str, int] = {}
        self.retries = 0
        self.migrations = 0  # streams that went on on another worker (--migration-limit)
        self.streams_lost = 0  # replies cut by their worker mid-way, not migrated
        self.client_aborts = 0
        self.unauthorized = 0  # refused for a missing or unknown API key (--api-key-file)
        self.rate_limited = 0  # refused with 429 by a tenant's rate limit
        self.session_affinity_hits = 0  # placed on their x-session-id's worker
        # served requests by how they met their TTFT and ITL targets (``pipeline.slo``)
        self.goodput: dict[str, int] = {}
        self.admission: AdmissionCounts | None = None  # the admission queue, when there is one
        self.upstream_timeouts = 0
        self.predicted_cached_tokens = 0
        self.actual_cached_tokens = 0
        self.usage_prompt_tokens = 0
        self.requests_with_usage = 0
        self.completion_tokens = 0
        self.tokenizer_cache_hit_tokens = 0
        self.tokenized_tokens = 0
        self.tokenized_off_loop = 0  # requests whose long prompt was tokenized in a thread
        self.tokenize_shared = 0  # of those, waits for another request's tokenizing instead
        self.engine_openai_requests = 0  # sent on with the client's body (see sidecar_body)
        self.media_requests = 0  # prompts with images: hashed in their media's namespace
        self.ttft = Histogram(_LATENCY_BUCKETS_S)
        self.itl = Histogram(_LATENCY_BUCKETS_S)
        self.latency = Histogram(_LATENCY_BUCKETS_S)
        self.placement = Histogram(_PLACEMENT_BUCKETS_S)
        self.registry = CollectorRegistry(auto_describe=False)
        self._gauges: Callable[[], dict[str, Any]] | None = None
        self.registry.register(_Collector(self))

    def count_response(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        self.responses[key] = self.responses.get(key, 0) + 1

    def set_gauge_source(self, source: Callable[[], dict[str, Any]]) -> None:
        """``source()`` → {"workers": [{"worker_id", "healthy", "in_flight", ...}], ...}."""
        self._gauges = source

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Collector:
    def __init__(self, m: GatewayMetrics) -> None:
        self.m = m

    def collect(self) -> Iterator[Metric]:
        m = self.m
        p = "kvsidecar_gateway_"
        c = CounterMetricFamily(
            p + "responses", "Responses sent, by endpoint and status", labels=["endpoint", "status"]
        )
        for (endpoint, status), n in sorted(m.responses.items()):
            c.add_metric([endpoint, str(status)], n)
        yield c
        goodput = CounterMetricFamily(
            p + "goodput_requests",
            "Served requests by how they met their targets (--slo-ttft-ms, --slo-itl-ms, or "
            "the request's x-kvsidecar-slo-* headers): met, missed_ttft, missed_itl, "
            "missed_both; goodput is met",
            labels=["outcome"],
        )
        for outcome, n in sorted(m.goodput.items()):
            goodput.add_metric([outcome], n)
        yield goodput
        for name, doc, table in (
            ("worker_requests", "Requests dispatched to each worker", m.worker_requests),
            (
                "worker_errors",
                "Requests that failed on each worker (connect or upstream loss)",
                m.worker_errors,
            ),
            (
                "worker_prompt_tokens",
                "Prompt tokens of the requests each worker served (hit-rate denominator)",
                m.worker_prompt_tokens,
            ),
            (
                "worker_predicted_cached_tokens",
                "Prompt tokens predicted cached at placement, per worker",
                m.worker_predicted_cached_tokens,
            ),
            (
                "worker_actual_cached_tokens",
                "Cached prompt tokens each worker reported in usage",
                m.worker_actual_cached_tokens,
            ),
            (
                "worker_usage_prompt_tokens",
                "Prompt tokens each worker reported in usage (hit rate: actual cached over these)",
                m.worker_usage_prompt_tokens,
            ),
            (
                "worker_prediction_checks",
                "Requests whose usage set the engine's cached tokens against the prediction",
                m.worker_prediction_checks,
            ),
            (
                "worker_overpredicted_tokens",
                "Of those, cached tokens predicted beyond what the engine reported",
                m.worker_overpredicted_tokens,
            ),
            (
                "worker_underpredicted_tokens",
                "Of those, cached tokens the engine reported beyond the prediction",
                m.worker_underpredicted_tokens,
            ),
        ):
            c = CounterMetricFamily(p + name, doc, labels=["worker"])
            for worker, n in sorted(table.items()):
                c.add_metric([worker], n)
            yield c
        c = CounterMetricFamily(
            p + "placement_reason",
            "Scored placements (kv, approx) by why the chosen worker won: best (it held the "
            "deepest overlap), tie, only_candidate, load (a deeper worker was busier), tier "
            "(the deeper match was in a slower tier), capacity (every deeper worker was "
            "full), sampled (--temperature), affinity (the client's x-session-id), interference "
            "(a deeper worker's decoding would slow too much)",
            labels=["reason"],
        )
        for reason, n in sorted(m.placement_reasons.items()):
            c.add_metric([reason], n)
        yield c
        for name, doc, value in (
            (
                "best_overlap_blocks",
                "Deepest prefix overlap any eligible worker held, summed over scored placements "
                "(achievable)",
                m.best_overlap_blocks,
            ),
            (
                "chosen_overlap_blocks",
                "Prefix overlap of the chosen worker, summed over scored placements (achieved)",
                m.chosen_overlap_blocks,
            ),
            ("retries", "Requests retried on another worker before the first byte", m.retries),
            (
                "migrations",
                "Streams whose worker died mid-reply, continued on another worker",
                m.migrations,
            ),
            (
                "streams_lost",
                "Replies cut mid-way by their worker and not continued (no --migration-limit, "
                "past it, or not resumable)",
                m.streams_lost,
            ),
            ("unauthorized", "Requests refused for a missing or unknown API key", m.unauthorized),
            ("rate_limited", "Requests refused by their tenant's rate limit", m.rate_limited),
            (
                "session_affinity_hits",
                "Requests placed on the worker their x-session-id was pinned to",
                m.session_affinity_hits,
            ),
            (
                "client_aborts",
                "Requests whose client went away (upstream aborted)",
                m.client_aborts,
            ),
            (
                "upstream_timeouts",
                "Requests abandoned after --upstream-timeout-s of silence",
                m.upstream_timeouts,
            ),
            (
                "predicted_cached_tokens",
                "Prompt tokens predicted cached at placement",
                m.predicted_cached_tokens,
            ),
            (
                "actual_cached_tokens",
                "Cached prompt tokens the engines reported in usage",
                m.actual_cached_tokens,
            ),
            (
                "usage_prompt_tokens",
                "Prompt tokens the engines reported in usage",
                m.usage_prompt_tokens,
            ),
            ("requests_with_usage", "Responses that carried a usage object", m.requests_with_usage),
            (
                "completion_tokens",
                "Generated tokens relayed (SSE events or usage)",
                m.completion_tokens,
            ),
            (
                "engine_openai_requests",
                "Requests sent to a sidecar with the client's body, for the engine's own OpenAI "
                "server: fields token ids cannot carry (tools, response_format, logprobs, "
                "n > 1, ...), a batch of prompts, or an endpoint the gateway does not tokenize",
                m.engine_openai_requests,
            ),
            (
                "media_requests",
                "Prompts with images or other media: hashed in a namespace of their media's "
                "digest, so they share no cached blocks with prompts without the same media",
                m.media_requests,
            ),
            (
                "tokenized_tokens",
                "Prompt tokens produced by the gateway's tokenizer",
                m.tokenized_tokens,
            ),
            (
                "tokenized_off_loop",
                "Requests whose long uncached prompt was tokenized in a worker thread (their "
                "own tokenizing, or another request's of the same text: tokenize_shared)",
                m.tokenized_off_loop,
            ),
            (
                "tokenizer_cache_hit_tokens",
                "Of those, tokens reused from the segment cache",
                m.tokenizer_cache_hit_tokens,
            ),
            (
                "tokenize_shared",
                "Waits of a request tokenized off the loop for another's tokenizing of the "
                "same text, instead of tokenizing it again",
                m.tokenize_shared,
            ),
        ):
            yield CounterMetricFamily(p + name, doc, value=value)
        for name, doc, h in (
            ("ttft_seconds", "Time to the first body byte from the worker", m.ttft),
            ("itl_seconds", "Mean inter-chunk latency of each stream", m.itl),
            ("request_duration_seconds", "Whole request, as the gateway saw it", m.latency),
            ("placement_seconds", "Parse + tokenize + hash + match + score", m.placement),
            (
                "missed_overlap_blocks",
                "Per scored placement, the deepest overlap on offer less the chosen worker's",
                m.missed_overlap,
            ),
        ):
            yield HistogramMetricFamily(p + name, doc, buckets=h.buckets(), sum_value=h.total)
        if m.admission is not None:
            yield from _admission_metrics(p, m.admission)
        if m._gauges is None:
            return
        state = m._gauges()
        labels = ["worker"]
        healthy = GaugeMetricFamily(
            p + "worker_healthy", "1 if the worker takes requests", labels=labels
        )
        in_flight = GaugeMetricFamily(p + "worker_in_flight", "Requests in flight", labels=labels)
        blocks = GaugeMetricFamily(
            p + "worker_active_blocks",
            "KV blocks held by in-flight requests (gateway's accounting)",
            labels=labels,
        )
        prefill = GaugeMetricFamily(
            p + "worker_active_prefill_tokens",
            "Uncached prompt tokens not yet prefilled",
            labels=labels,
        )
        parity = GaugeMetricFamily(
            p + "worker_hash_parity",
            "1 for the worker's hash parity: exact, degraded (cache predictions are wrong), "
            "falling_back (placed by load alone), unverified or pending (not checked yet)",
            labels=["worker", "parity"],
        )
        source = GaugeMetricFamily(
            p + "worker_load_source",
            "1 for what the worker's load is placed by: engine (the engine's own load reading "
            "beside the gateway's count) or gateway (the gateway's count alone)",
            labels=["worker", "source"],
        )
        engine = {
            key: GaugeMetricFamily(p + "worker_engine_" + key, doc, labels=labels)
            for key, doc in (
                ("running", "Requests running, as the worker's engine last reported"),
                ("queued", "Requests queued, as the worker's engine last reported"),
                ("kv_usage", "Fraction of the KV pool in use, as the worker's engine last "
                 "reported"),
            )
        }
        itl = {
            key: GaugeMetricFamily(p + "worker_itl_" + key, doc, labels=labels)
            for key, doc in (
                ("base_seconds", "Learned inter-token latency of the worker with no stream "
                 "in flight (decode interference: base + per_stream x in flight)"),
                ("per_stream_seconds", "Learned inter-token latency each request in flight "
                 "adds on the worker"),
                ("next_seconds", "Inter-token latency the worker's batch is predicted to "
                 "have with one more stream"),
            )
        }
        for w in state["workers"]:
            wid = w["worker_id"]
            model = w.get("itl_model")
            if model:
                itl["base_seconds"].add_metric([wid], model["base_s"])
                itl["per_stream_seconds"].add_metric([wid], model["per_stream_s"])
                itl["next_seconds"].add_metric([wid], model["next_itl_s"])
            if "parity" in w:
                parity.add_metric([wid, w["parity"]], 1.0)
            healthy.add_metric([wid], 1.0 if w["healthy"] else 0.0)
            in_flight.add_metric([wid], w["in_flight"])
            blocks.add_metric([wid], w["active_blocks"])
            prefill.add_metric([wid], w["active_prefill_tokens"])
            if "load_source" in w:
                source.add_metric([wid, w["load_source"]], 1.0)
            reading = w.get("engine_load")
            if reading:
                for key, family in engine.items():
                    if reading[key] is not None:
                        family.add_metric([wid], reading[key])
        yield from (healthy, in_flight, blocks, prefill, parity, source, *engine.values(),
                    *itl.values())
        yield from _scorer_metrics(p, state.get("scorer"))


def _scorer_metrics(p: str, scorer: dict[str, Any] | None) -> Iterator[Metric]:
    """The scorer's weights now, learned or fixed, and the decode-interference fit."""
    if not scorer:
        return
    for key, doc in (
        ("overlap_weight", "Credit per GPU-cached prefix block, in blocks of prefill work "
         "(learned from eviction pressure unless fixed)"),
        ("prefill_load_scale", "Weight of a block of prefill work against a block held by "
         "decoding requests (learned from TTFT unless fixed)"),
    ):
        yield GaugeMetricFamily(p + "scorer_" + key, doc, value=scorer[key])
    decode = scorer.get("decode_interference")
    if not decode:
        return
    yield GaugeMetricFamily(p + "decode_interference_weight",
                            "Weight of the decode-interference term (--decode-interference-"
                            "weight)", value=decode["weight"])
    yield GaugeMetricFamily(p + "decode_interference_priced",
                            "1 once the decode-interference term has a fit and prices "
                            "placements", value=1.0 if decode["priced"] else 0.0)
    yield CounterMetricFamily(p + "decode_interference_moves",
                              "Placements the decode-interference term moved: the chosen "
                              "worker is not among the cheapest by the cost without it "
                              "(wider than placement_reason interference, which counts "
                              "only moves off a deeper prefix holder)", value=decode["moves"])
    for key, name, doc in (
        ("output_tokens", "output_tokens", "Mean tokens a request streams (learned)"),
        ("prefill_s_per_token", "prefill_seconds_per_token",
         "Seconds of prefill per uncached prompt token (the TTFT fit)"),
        ("fleet_itl_base_s", "fleet_itl_base_seconds",
         "Learned fleet-wide inter-token latency with nothing in flight"),
        ("fleet_itl_per_stream_s", "fleet_itl_per_stream_seconds",
         "Learned fleet-wide inter-token latency per request in flight"),
    ):
        if decode[key] is not None:
            yield GaugeMetricFamily(p + "decode_" + name, doc, value=decode[key])


class AdmissionCounts(Protocol):
    """What the admission queue counts (``routing.pipeline.admission.AdmissionQueue``)."""

    num_queued: int
    num_admitted: int
    num_expired: int
    num_full: int
    num_shed: int
    num_for_prefix: int

    def __len__(self) -> int: ...


def _admission_metrics(p: str, q: AdmissionCounts) -> list[Metric]:
    c = CounterMetricFamily(
        p + "admission_requests",
        "Requests that found every worker busy, by outcome: queued (waited), admitted "
        "(placed after waiting), expired (503 after --queue-timeout-s), full (429: the queue "
        "was full of requests ranking ahead), shed (429: left the full queue for one ranking "
        "ahead, of a tenant under its fair share)",
        labels=["outcome"],
    )
    for outcome, n in (("queued", q.num_queued), ("admitted", q.num_admitted),
                       ("expired", q.num_expired), ("full", q.num_full),
                       ("shed", q.num_shed)):
        c.add_metric([outcome], n)
    waiting = GaugeMetricFamily(p + "admission_waiting", "Requests waiting for a worker now",
                                value=len(q))
    for_prefix = CounterMetricFamily(
        p + "admission_for_prefix",
        "Waiting requests admitted ahead of the queue's head, to a freed worker holding their "
        "prefix while a busy one held the head's (--queue-lookahead)", value=q.num_for_prefix)
    return [c, waiting, for_prefix]
