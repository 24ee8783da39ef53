"""Counters of the replica link, exported on the gateway's ``/metrics``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["ReplicaMetrics"]


def _zero() -> int:
    return 0


class ReplicaMetrics:
    """What the link did; the gauges are read from the link when scraped."""

    def __init__(self) -> None:
        self.connected = False
        self.nats_errors = 0  # failed connects and connection errors
        self.disconnects = 0
        self.batches_published = 0
        self.events_published = 0
        self.snapshots_published = 0
        self.events_dropped = 0  # local events never published: NATS unreachable
        self.batches_received = 0
        self.batches_rejected = 0  # undecodable frames
        self.resyncs_asked = 0
        self.peers: Callable[[], int] = _zero
        self.remote_requests: Callable[[], int] = _zero
        self.peers_lost: Callable[[], int] = _zero
        self.gaps: Callable[[], int] = _zero

    def collect(self) -> Iterator[Metric]:
        p = "kvsidecar_gateway_replica_"
        for name, doc, value in (
            ("nats_errors", "Failed NATS connects and connection errors", self.nats_errors),
            ("nats_disconnects", "Times the NATS connection was lost", self.disconnects),
            ("batches_published", "Batches of placements published", self.batches_published),
            ("events_published", "Placement and lifecycle events published",
             self.events_published),
            ("snapshots_published", "Snapshots of the requests in flight published",
             self.snapshots_published),
            ("events_dropped", "Events not published because NATS was unreachable",
             self.events_dropped),
            ("batches_received", "Batches received from other replicas", self.batches_received),
            ("batches_rejected", "Frames from other replicas that did not decode",
             self.batches_rejected),
            ("gaps", "Batches received after a missed one", self.gaps()),
            ("resyncs_asked", "Snapshots asked of other replicas", self.resyncs_asked),
            ("peers_lost", "Replicas dropped, with their load, for silence", self.peers_lost()),
        ):
            yield CounterMetricFamily(p + name, doc, value=value)
        yield GaugeMetricFamily(p + "nats_connected", "1 while connected to NATS",
                                value=int(self.connected))
        yield GaugeMetricFamily(p + "peers", "Other replicas heard from", value=self.peers())
        yield GaugeMetricFamily(p + "remote_requests",
                                "Other replicas' requests in flight, counted in the load here",
                                value=self.remote_requests())
