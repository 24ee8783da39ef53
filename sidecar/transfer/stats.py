"""Counters of the transfer service, per transport, for ``/metrics`` and tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from sidecar.transfer.messages import Transport

__all__ = ["PullRecord", "TransferStats", "TransportStats"]


@dataclass(frozen=True, slots=True)
class PullRecord:
    """One finished pull, as reported to the service's ``on_pull`` callback."""

    transport: Transport
    num_blocks: int
    num_bytes: int
    seconds: float
    error_code: str | None  # None: imported; else the ``TransferError.code`` it failed with


@dataclass(slots=True)
class TransportStats:
    num_pulls: int = 0
    num_failed: int = 0
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class TransferStats:
    """Importer and exporter counters since the service started."""

    by_transport: dict[Transport, TransportStats] = field(
        default_factory=lambda: {t: TransportStats() for t in Transport})
    num_exports_opened: int = 0
    num_exports_expired: int = 0
    num_exports_open: int = 0
    num_offers_received: int = 0  # exports peers granted us (NIXL, TCP pulls in flight too)
    num_stream_bytes_received: int = 0  # TCP bytes read so far, including pulls in flight
    num_stream_bytes_sent: int = 0
    num_release_failures: int = 0  # releases the peer did not acknowledge (its TTL frees them)

    def record(self, record: PullRecord) -> None:
        stats = self.by_transport[record.transport]
        stats.num_pulls += 1
        if record.error_code is not None:
            stats.num_failed += 1
            return
        stats.num_blocks += record.num_blocks
        stats.num_bytes += record.num_bytes
        stats.seconds += record.seconds
