"""The sidecar's Prometheus metrics, in a registry it owns (served at ``/metrics``).

Counters the components already keep (the event streams' relay counts, the load tracker)
are read at scrape time by a collector, so the hot paths count once, in plain ints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shm.owner.server import BlockStoreOwner
from shm.tiers.disk_tier import DiskTierStats
from shm.tiers.remote_tier import RemoteTierStats
from sidecar.event_stream import EventStream
from sidecar.load import LoadTracker

__all__ = ["SidecarMetrics"]


class _StreamCollector(Collector):
    def __init__(
        self,
        streams: Callable[[], dict[str, EventStream]],
        load: Callable[[], LoadTracker | None],
        store: Callable[[], BlockStoreOwner | None],
    ) -> None:
        self._streams = streams
        self._load = load
        self._store = store

    def collect(self) -> Iterator[Metric]:
        relayed = CounterMetricFamily(
            "kvsidecar_events_relayed", "KV events relayed to gateways", labels=["worker"]
        )
        subscribers = GaugeMetricFamily(
            "kvsidecar_event_subscribers",
            "Gateways subscribed to the event stream",
            labels=["worker"],
        )
        status_only = GaugeMetricFamily(
            "kvsidecar_event_subscribers_status_only",
            "Subscribers reading the live events from JetStream (--events-via nats)",
            labels=["worker"],
        )
        replays = CounterMetricFamily(
            "kvsidecar_stream_replays",
            "Subscribers resumed from the replay buffer",
            labels=["worker"],
        )
        snapshots = CounterMetricFamily(
            "kvsidecar_stream_snapshots",
            "Subscribers (re)synced from a snapshot",
            labels=["worker"],
        )
        dropped = CounterMetricFamily(
            "kvsidecar_stream_resyncs_forced",
            "Subscribers dropped for falling behind (told to resync)",
            labels=["worker"],
        )
        for worker, stream in self._streams().items():
            relayed.add_metric([worker], stream.events_relayed)
            subscribers.add_metric([worker], stream.num_subscribers)
            status_only.add_metric([worker], stream.num_status_only)
            replays.add_metric([worker], stream.replays_served)
            snapshots.add_metric([worker], stream.snapshots_served)
            dropped.add_metric([worker], stream.subscribers_dropped)
        yield from (relayed, subscribers, status_only, replays, snapshots, dropped)
        load = self._load()
        if load is not None:
            in_flight = GaugeMetricFamily(
                "kvsidecar_requests_in_flight", "Requests proxied to the engine now"
            )
            in_flight.add_metric([], load.in_flight)
            done = CounterMetricFamily(
                "kvsidecar_requests", "Requests proxied, by outcome", labels=["outcome"]
            )
            done.add_metric(["ok"], load.completed)
            done.add_metric(["error"], load.failed)
            yield from (in_flight, done)
        store = self._store()
        if store is not None:
            stats = store.stats()
            lookups = CounterMetricFamily(
                "kvsidecar_store_lookups", "Host-tier store lookups, by result", labels=["result"]
            )
            lookups.add_metric(["hit"], stats.num_hits)
            lookups.add_metric(["miss"], stats.num_misses)
            evictions = CounterMetricFamily("kvsidecar_store_evictions", "Blocks evicted (LRU)")
            evictions.add_metric([], stats.num_evictions)
            blocks = GaugeMetricFamily(
                "kvsidecar_store_blocks",
                "Blocks held, slots granted to writers ahead of their puts, and slots in all",
                labels=["kind"],
            )
            blocks.add_metric(["held"], stats.num_blocks)
            blocks.add_metric(["granted"], stats.num_granted)
            blocks.add_metric(["slots"], stats.num_slots)
            yield from (lookups, evictions, blocks)
            if store.disk is not None:
                yield from _disk_tier_metrics(store.disk.stats())
            if store.remote is not None:
                yield from _remote_tier_metrics(store.remote.stats())


def _disk_tier_metrics(d: DiskTierStats) -> list[Metric]:
    blocks = CounterMetricFamily(
        "kvsidecar_disk_tier_blocks",
        "Disk-tier blocks written, read back into the store, evicted (LRU), dropped as "
        "corrupt, and evicted from the store but not kept (the writer fell behind)",
        labels=["op"],
    )
    for op, value in (("written", d.num_writes), ("read", d.num_reads),
                      ("evicted", d.num_evictions), ("corrupt", d.num_corrupt),
                      ("dropped", d.num_dropped)):
        blocks.add_metric([op], value)
    moved = CounterMetricFamily(
        "kvsidecar_disk_tier_bytes", "Disk-tier bytes written and read", labels=["op"])
    moved.add_metric(["written"], d.num_write_bytes)
    moved.add_metric(["read"], d.num_read_bytes)
    errors = CounterMetricFamily(
        "kvsidecar_disk_tier_errors", "Disk-tier I/O errors (each a miss or a block not kept)")
    errors.add_metric([], d.num_errors)
    held = GaugeMetricFamily(
        "kvsidecar_disk_tier_held", "Disk-tier blocks and bytes held, and its capacity",
        labels=["kind"])
    held.add_metric(["blocks"], d.num_blocks)
    held.add_metric(["bytes"], d.num_bytes)
    held.add_metric(["capacity_bytes"], d.capacity_bytes)
    return [blocks, moved, errors, held]


def _remote_tier_metrics(r: RemoteTierStats) -> list[Metric]:
    blocks = CounterMetricFamily(
        "kvsidecar_remote_tier_blocks",
        "Remote-tier blocks written, read back into the store, listed but gone when read "
        "(missed), dropped as corrupt, and not written (queue full or the store away)",
        labels=["op"],
    )
    for op, value in (("written", r.num_writes), ("read", r.num_reads),
                      ("missed", r.num_misses), ("corrupt", r.num_corrupt),
                      ("dropped", r.num_dropped)):
        blocks.add_metric([op], value)
    moved = CounterMetricFamily(
        "kvsidecar_remote_tier_bytes", "Remote-tier bytes written and read", labels=["op"])
    moved.add_metric(["written"], r.num_write_bytes)
    moved.add_metric(["read"], r.num_read_bytes)
    errors = CounterMetricFamily(
        "kvsidecar_remote_tier_errors",
        "Failed remote-store calls (each a miss or a block not written)")
    errors.add_metric([], r.num_errors)
    held = GaugeMetricFamily(
        "kvsidecar_remote_tier_held",
        "Blocks the shared store holds for this model, and whether it is reachable",
        labels=["kind"])
    held.add_metric(["blocks"], r.num_blocks)
    held.add_metric(["connected"], int(r.connected))
    return [blocks, moved, errors, held]


class SidecarMetrics:
    """The registry plus the histograms the sidecar observes directly."""

    def __init__(
        self,
        streams: Callable[[], dict[str, EventStream]],
        load: Callable[[], LoadTracker | None],
        store: Callable[[], BlockStoreOwner | None],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StreamCollector(streams, load, store))
        self.proxy_latency = Histogram(
            "kvsidecar_proxy_seconds",
            "Time from receiving a request to the end of its answer",
            buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.transfer_bytes = Counter(
            "kvsidecar_transfer_bytes",
            "KV bytes pulled from peer sidecars, by transport and outcome",
            ["transport", "outcome"],
            registry=self.registry,
        )
        self.kv_moves = Counter(
            "kvsidecar_kv_moves",
            "Prefixes the gateway moved here from the worker holding them, by outcome (ok, "
            "or the failed pull's code: the request was recomputed)",
            ["outcome"],
            registry=self.registry,
        )
        self.transfer_seconds = Histogram(
            "kvsidecar_transfer_seconds",
            "Duration of one pull from a peer sidecar, by transport and outcome",
            ["transport", "outcome"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 30),
            registry=self.registry,
        )
