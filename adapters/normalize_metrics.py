"""Prometheus counters every adapter keeps, in a registry it owns or is given.

Nothing is registered in prometheus_client's global default registry: a sidecar passes its
own ``CollectorRegistry`` (the one its ``/metrics`` serves), tests get a fresh one each.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

__all__ = ["AdapterMetrics"]


class AdapterMetrics:
    """Counters of one adapter, labelled by engine and worker.

    * ``engine_events``: native events decoded, by native type;
    * ``blocks``: blocks by outcome (``stored``, ``removed``, ``orphaned`` — parent unknown,
      ``skipped`` — partial or multimodal block, ``unknown_removed``, ``filtered``);
    * ``gaps``, ``replays`` (by outcome), ``resyncs`` (by reason), ``decode_errors`` (by kind);
    * ``load_readings``: the engine's own load readings taken (an engine that publishes them).
    """

    def __init__(self, engine: str, registry: CollectorRegistry | None = None) -> None:
        self.engine = engine
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        labels = ["engine", "worker"]
        self.engine_events = Counter(
            "kvsidecar_adapter_engine_events",
            "Native KV events decoded, by native event type",
            [*labels, "type"],
            registry=self.registry,
        )
        self.blocks = Counter(
            "kvsidecar_adapter_blocks",
            "Blocks seen in native events, by what became of them",
            [*labels, "outcome"],
            registry=self.registry,
        )
        self.gaps = Counter(
            "kvsidecar_adapter_sequence_gaps",
            "Sequence gaps detected in a native event stream",
            labels,
            registry=self.registry,
        )
        self.replays = Counter(
            "kvsidecar_adapter_replays",
            "Replay requests to the engine, by outcome",
            [*labels, "outcome"],
            registry=self.registry,
        )
        self.resyncs = Counter(
            "kvsidecar_adapter_resyncs",
            "Full resyncs (a new epoch), by reason",
            [*labels, "reason"],
            registry=self.registry,
        )
        self.decode_errors = Counter(
            "kvsidecar_adapter_decode_errors",
            "Native events or frames that could not be decoded or normalized, by kind",
            [*labels, "kind"],
            registry=self.registry,
        )
        self.load_readings = Counter(
            "kvsidecar_adapter_engine_load_readings",
            "Load readings the engine's scheduler published and the adapter decoded",
            labels,
            registry=self.registry,
        )

    def value(self, name: str, **labels: str) -> float:
        """The current value of one counter child (0 when never incremented); for tests/CLIs."""
        sample = self.registry.get_sample_value(
            f"kvsidecar_adapter_{name}_total", {"engine": self.engine, **labels}
        )
        return 0.0 if sample is None else sample
