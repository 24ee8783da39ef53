"""One rank's batches → canonical events: the bookkeeping every ZMQ adapter shares.

``BatchNormalizer.apply`` decodes a payload with the adapter's typed fast path, falls back
to its lenient decoder (which returns each event it cannot convert as a ``BadEvent``), hands
the events to the adapter's ``_apply_events`` and flushes the block counters once per batch.
A malformed event or frame is counted and logged once per seq (a resync replays it again,
and counting it twice would say two events broke), and the caller resyncs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import msgspec
import structlog

from adapters.normalize import MalformedEventError, WorkerNormalizer
from adapters.normalize_metrics import AdapterMetrics
from adapters.zmq_events.framing import BadEvent, FrameError
from kvcore.events import KVEvent, Tier

__all__ = ["EVENT_TYPES", "BatchNormalizer", "BlockSizeMismatchError", "tier_of"]

log = structlog.get_logger(component="adapters.zmq_events")

EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
_HEAD = 64
_MAX_BAD_SEQS = 4096

# The ``medium`` of a stored or removed block (vLLM's strings, which SGLang's
# ``StorageMedium`` copies) → our tier; None is the engine's own GPU pool.
_MEDIUM_TIERS = {
    None: Tier.GPU,
    "GPU": Tier.GPU,
    "CPU_PINNED": Tier.HOST,
    "CPU": Tier.HOST,
    "DISK": Tier.DISK,
    "EXTERNAL": Tier.REMOTE,
}


def tier_of(medium: str | None) -> Tier | None:
    """A ``medium`` → tier (None: unknown medium)."""
    return _MEDIUM_TIERS.get(medium)


class BlockSizeMismatchError(RuntimeError):
    """The engine publishes blocks of another size than the adapter hashes with."""


class BatchNormalizer(ABC):
    """Turns one rank's batches into canonical events (through a ``WorkerNormalizer``)."""

    def __init__(self, normalizer: WorkerNormalizer, metrics: AdapterMetrics) -> None:
        self.normalizer = normalizer
        self.metrics = metrics
        worker = normalizer.worker_id
        self._type_counters = {
            name: metrics.engine_events.labels(metrics.engine, worker, name)
            for name in EVENT_TYPES
        }
        self._worker = worker
        self._bad_seqs: set[int] = set()

    # --- what each engine brings ------------------------------------------------------------

    @abstractmethod
    def _decode(self, payload: bytes) -> Sequence[Any]:
        """The batch's events, typed (``msgspec`` errors on anything odd)."""

    @abstractmethod
    def _decode_lenient(self, payload: bytes) -> Sequence[Any]:
        """The batch's events one by one, ``BadEvent`` for each that does not convert;
        ``FrameError`` only if the payload is not a batch at all."""

    @abstractmethod
    def _apply_events(self, seq: int, events: Sequence[Any], out: list[KVEvent]) -> bool:
        """Normalize the decoded events into ``out``; False when one was malformed."""

    # --- shared -------------------------------------------------------------------------------

    def publisher_restarted(self) -> None:
        """A new publisher counts from 0 again: seqs seen before mean nothing now."""
        self._bad_seqs.clear()

    def resync(self, out: list[KVEvent]) -> None:
        """What the engine holds is unknown: drop the worker's state (``AllBlocksCleared``)."""
        self.normalizer.resync(out)

    def apply(self, seq: int, payload: bytes, out: list[KVEvent]) -> bool:
        """Normalize one batch into ``out``; False when something in it was malformed (the
        caller resyncs)."""
        try:
            events = self._decode(payload)
        except (msgspec.MsgspecError, ValueError, TypeError, RecursionError):
            try:
                events = self._decode_lenient(payload)
            except FrameError as exc:
                self._bad(seq, "frame", str(exc), payload)
                return False
        try:
            return self._apply_events(seq, events, out)
        finally:
            self.normalizer.flush_metrics()

    def _tier(self, medium: str | None) -> Tier:
        tier = tier_of(medium)
        if tier is None:
            raise MalformedEventError(f"unknown storage medium {medium!r}")
        return tier

    def _check_block_size(self, block_size: int, hint: str) -> None:
        """``BlockSizeMismatchError`` when the engine's blocks are not the adapter's: no
        resync can fix a misconfiguration. ``hint``: what the engine's block size is."""
        ours = self.normalizer.block_size
        if block_size != ours:
            raise BlockSizeMismatchError(
                f"{self.metrics.engine} worker {self._worker} published blocks of {block_size} "
                f"tokens but the adapter hashes blocks of {ours}; start the sidecar with "
                f"--block-size {block_size} ({hint})"
            )

    def _bad_event(self, seq: int, event: BadEvent) -> None:
        self._bad(seq, "event", event.reason, msgspec.msgpack.encode(event.raw))

    def _count(self, stored: int, removed: int, cleared: int) -> None:
        """Add one batch's native events to the per-type counters."""
        for name, n in zip(EVENT_TYPES, (stored, removed, cleared), strict=True):
            if n:
                self._type_counters[name].inc(n)

    def _short_chain_locals(
        self, chains: Sequence[tuple[int, int, list[int]]]
    ) -> dict[int, list[int] | None]:
        """Block locals of a batch's short stored chains ``(event index, blocks, token
        ids)``, hashed in one vectorized pass, by event index (empty: not worth it)."""
        if len(chains) < 2:
            return {}
        locs = self.normalizer.short_chain_locals([(n, tokens) for _, n, tokens in chains])
        if locs is None:
            return {}
        return {i: loc for (i, _, _), loc in zip(chains, locs, strict=True)}

    def _bad(self, seq: int, kind: str, reason: str, raw: bytes) -> None:
        if seq in self._bad_seqs:
            return  # already counted when first seen (a resync replays it again)
        if len(self._bad_seqs) > _MAX_BAD_SEQS:
            self._bad_seqs.clear()
        self._bad_seqs.add(seq)
        self.metrics.decode_errors.labels(self.metrics.engine, self._worker, kind).inc()
        log.error(
            "kv_event_decode_failed",
            engine=self.metrics.engine,
            worker_id=self._worker,
            seq=seq,
            kind=kind,
            reason=reason,
            raw_len=len(raw),
            raw_head=raw[:_HEAD].hex(),
        )
