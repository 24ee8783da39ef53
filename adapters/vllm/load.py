"""vLLM's own load, per DP rank, from its Prometheus ``/metrics`` (and ``/load``).

vLLM publishes no load socket; its scheduler's gauges are labelled by ``engine`` (the DP
rank): ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before it), and
``vllm:cache_config_info`` names ``block_size`` and ``num_gpu_blocks`` (the KV pool) in its
labels (``vllm/v1/metrics/loggers.py``). ``GET /load`` answers ``{"server_load": N}``, the
API server's requests in flight (``--enable-server-load-tracking``): the running count of a
single-rank engine whose metrics lack the scheduler's gauges.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvcore.stream import EngineLoad

__all__ = ["MetricsReading", "parse_metrics", "to_loads"]

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_CACHE_INFO = "vllm:cache_config_info"


@dataclass(frozen=True, slots=True)
class MetricsReading:
    """One scrape: the gauges by DP rank, and the KV pool when vLLM names it."""

    running: Mapping[int, float]
    waiting: Mapping[int, float]
    usage: Mapping[int, float]
    block_size: int | None = None
    num_gpu_blocks: int | None = None

    @property
    def capacity_tokens(self) -> int | None:
        if self.block_size and self.num_gpu_blocks:
            return self.block_size * self.num_gpu_blocks
        return None


def parse_metrics(text: str) -> MetricsReading:
    """Read vLLM's gauges out of a ``/metrics`` page (``ValueError`` if it is not one)."""
    running: dict[int, float] = {}
    waiting: dict[int, float] = {}
    usage: dict[int, float] = {}
    block_size = blocks = None
    wanted = {_RUNNING: running, _WAITING: waiting, **dict.fromkeys(_USAGE, usage)}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            target = wanted.get(sample.name)
            if target is not None:
                rank = int(sample.labels.get("engine") or 0)
                target.setdefault(rank, sample.value)
            elif sample.name == _CACHE_INFO:
                block_size = _int(sample.labels.get("block_size"))
                blocks = _int(sample.labels.get("num_gpu_blocks"))
    return MetricsReading(running, waiting, usage, block_size, blocks)


def to_loads(
    reading: MetricsReading, dp_size: int, server_load: int | None = None
) -> dict[int, EngineLoad]:
    """Each rank's ``EngineLoad`` (a rank without the scheduler's gauges has none, except a
    single rank, which ``/load``'s count stands in for)."""
    capacity = reading.capacity_tokens
    loads = {}
    for rank in range(dp_size):
        running = reading.running.get(rank)
        if running is None and dp_size == 1 and server_load is not None:
            running = float(server_load)
        if running is None:
            continue
        used = reading.usage.get(rank)
        loads[rank] = EngineLoad(
            running=int(running),
            queued=int(reading.waiting.get(rank, 0)),
            kv_used_tokens=int(used * capacity) if used is not None and capacity else 0,
            kv_capacity_tokens=capacity,
        )
    return loads


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "", "None") else None
    except ValueError:
        return None
