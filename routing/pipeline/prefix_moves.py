"""A moved placement on the wire: where the worker's sidecar pulls from, and what it said.

The placement core decides a move (``routing.placement.kv_move``); this stage tells the
chosen worker's sidecar where the prefix is (``PrefixSource`` in the request's body) and
hears back, in the answer's ``x-kvsidecar-kv-pull`` header, how the pull went: the planner
learns the pull's speed from it and backs off a source whose pull failed, and the gateway
counts each outcome (``kvsidecar_gateway_kv_moves_total``). A failed pull was a recompute on
the worker: the request was served all the same.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvcore.events import Tier
from kvcore.requests import PrefixSource
from routing.placement.kv_move import MovePlanner, parse_pull
from routing.placement.scorer import Placement
from routing.vocabulary import pull_transport
from routing.workers.registry import Worker, WorkerRegistry

__all__ = ["PrefixMoves"]

# A pull slower than this costs more than recomputing all but the longest prompts.
PULL_TIMEOUT_S = 2.0


class PrefixMoves:
    """The moves of one gateway: their sources on the way out, their reports on the way
    back, and their counts on ``/metrics``."""

    def __init__(self, planner: MovePlanner, workers: WorkerRegistry, transport: str) -> None:
        self.planner = planner
        self._workers = workers
        self._transport = transport
        self.outcomes: dict[str, int] = {}  # "ok", or the failed pull's code → requests

    def source(self, worker: Worker, placement: Placement,
               block_hashes: Sequence[int]) -> PrefixSource | None:
        """What ``worker``'s sidecar pulls for a moved ``placement`` (None: not a move, or
        its source left the fleet since: the worker recomputes)."""
        source_id = placement.moved_from
        if source_id is None:
            return None
        holder = self._workers.get(source_id)
        if holder is None:
            return None
        transport = pull_transport(self._transport, holder.address.host, worker.address.host)
        return PrefixSource(
            peer_url=holder.address.url,
            block_hashes=list(block_hashes[: placement.overlap.depths[Tier.HOST]]),
            transport=transport,  # type: ignore[arg-type]  # checked by RouterConfig
            timeout_s=PULL_TIMEOUT_S,
        )

    def reported(self, placement: Placement, header: bytes | None) -> None:
        """The moved request's answer came with ``header`` (None: its sidecar said nothing,
        an older one: counted as ``unreported``)."""
        source_id = placement.moved_from
        if source_id is None:
            return
        report = None if header is None else parse_pull(header)
        if report is None:
            outcome = "unreported"
        else:
            outcome = "ok" if report.ok else report.error or "failed"
            self.planner.reported(source_id, report)
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def collect(self) -> Iterator[Metric]:
        p = "kvsidecar_gateway_"
        planner = self.planner
        c = CounterMetricFamily(
            p + "kv_moves", "Requests placed on a worker that pulled their prefix from "
            "another worker's store, by the pull's outcome (ok, or the failed pull's code: "
            "the worker recomputed)", labels=["outcome"])
        for outcome, n in sorted(self.outcomes.items()):
            c.add_metric([outcome], n)
        yield c
        yield GaugeMetricFamily(
            p + "kv_move_pull_ratio", "A pulled block's time over a prefilled block's, as "
            "learned (the share of a recompute a pull costs)", value=planner.ratio())
        gbps = planner.gbytes_per_s()
        yield GaugeMetricFamily(
            p + "kv_move_pull_gbytes_per_second", "The moves' pulls' measured throughput "
            "(0 before the first)", value=0.0 if gbps is None else gbps)
