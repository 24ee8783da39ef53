"""Counters of the replica link and of the durable events, on the gateway's ``/metrics``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["DurableMetrics", "ReplicaMetrics"]


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
        self.spread: Callable[[], int] = _zero
        self.held: Callable[[], int] = _zero
        self.held_followed: Callable[[], int] = _zero
        self.held_claimed: Callable[[], int] = _zero
        self.held_timed_out: Callable[[], int] = _zero
        self.claims: Callable[[], int] = _zero

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
            ("new_prefix_spread", "New prefixes placed with the peers' share of the workers "
             "weighed (routing/placement/peer_share.py)", self.spread()),
            ("new_prompts_held", "New prompts held for the replica that owns them "
             "(routing/replicas/prompt_hold.py)", self.held()),
            ("new_prompts_held_followed", "Held prompts released when the owner's placement "
             "of them (or a change of peers) was heard", self.held_followed()),
            ("new_prompts_held_claimed", "Held prompts released when the owner, asked past "
             "--nats-new-prompt-window-ms, named their worker", self.held_claimed()),
            ("new_prompts_held_timed_out", "Held prompts placed here at 20 windows, nothing "
             "heard from the owner", self.held_timed_out()),
            ("new_prompts_claimed", "New prompts this replica placed as their owner, asked by "
             "a peer holding a session of them", self.claims()),
        ):
            yield CounterMetricFamily(p + name, doc, value=value)
        yield GaugeMetricFamily(p + "nats_connected", "1 while connected to NATS",
                                value=int(self.connected))
        yield GaugeMetricFamily(p + "peers", "Other replicas heard from", value=self.peers())
        yield GaugeMetricFamily(p + "remote_requests",
                                "Other replicas' requests in flight, counted in the load here",
                                value=self.remote_requests())


class DurableMetrics:
    """What the durable events did (``routing/replicas/durable.py``)."""

    def __init__(self) -> None:
        self.live = False  # reading JetStream: the sidecars' streams carry status only
        self.stream_seq = 0  # the last stream message applied
        self.messages = 0
        self.events_applied = 0
        self.messages_rejected = 0  # undecodable messages: logged, counted, skipped
        self.gaps = 0  # workers found behind (a gap, a marker ahead): resynced from the sidecar
        self.snapshots_written = 0
        self.snapshot_seq = 0  # the stream message the newest snapshot written covers
        self.snapshot_failures = 0
        self.snapshot_loaded_blocks = 0  # what the newest snapshot held at start (0: none)
        self.warm_start_s = 0.0  # start to caught up: snapshot loaded, stream replayed
        self.nats_errors = 0

    def collect(self) -> Iterator[Metric]:
        p = "kvsidecar_gateway_durable_"
        for name, doc, value in (
            ("messages", "JetStream messages of KV events read", self.messages),
            ("events_applied", "KV events applied from JetStream", self.events_applied),
            ("messages_rejected", "JetStream messages that did not decode (skipped)",
             self.messages_rejected),
            ("gaps", "Workers found behind on JetStream, resynced from their sidecar", self.gaps),
            ("snapshots_written", "Index snapshots written to the object store",
             self.snapshots_written),
            ("snapshot_failures", "Index snapshots not written or not loadable",
             self.snapshot_failures),
            ("nats_errors", "Failed NATS connects and connection errors", self.nats_errors),
        ):
            yield CounterMetricFamily(p + name, doc, value=value)
        for name, doc, gauge in (
            ("live", "1 while the KV events come from JetStream", int(self.live)),
            ("stream_seq", "The last JetStream message applied", self.stream_seq),
            ("snapshot_stream_seq", "The JetStream message the newest snapshot written covers",
             self.snapshot_seq),
            ("snapshot_loaded_blocks", "Blocks of the snapshot loaded at start",
             self.snapshot_loaded_blocks),
            ("warm_start_seconds", "Start to caught up with the stream", self.warm_start_s),
        ):
            yield GaugeMetricFamily(p + name, doc, value=gauge)
