"""The pure core of the SGLang subscriber: sequence tracking and batch normalization.

No sockets and no asyncio here; ``subscriber.py`` feeds this from ZMQ.

Sequence rules (one publisher = one DP rank; seq starts at 0 and grows by 1 per batch):

* live ``seq == last + 1`` → apply; a live seq that jumps ahead → a gap, fill it by replay
  from ``last + 1``;
* a live seq at or below the last *live* seq → the publisher restarted (its counter reset):
  new epoch, then rebuild;
* a live seq at or below the last *applied* one but above the last live one → a duplicate of
  what a replay already delivered: skip;
* a replay that starts past the requested seq → the range is gone from the publisher's
  buffer: full resync (new epoch, then rebuild from whatever the buffer still holds).
"""

from __future__ import annotations

import enum

import msgspec
import structlog

from adapters.normalize import MalformedEventError, WorkerNormalizer
from adapters.normalize_hashing import SHORT_CHAIN_BLOCKS
from adapters.normalize_metrics import AdapterMetrics
from adapters.sglang.wire import (
    BadEvent,
    FrameError,
    SgAllBlocksCleared,
    SgBlockRemoved,
    SgBlockStored,
    SgEvent,
    decode_batch,
    decode_batch_lenient,
    tier_of,
)
from kvcore.events import KVEvent, Tier

__all__ = ["BlockSizeMismatchError", "RankNormalizer", "RankSequencer", "SeqAction"]

log = structlog.get_logger(component="adapters.sglang")

_HEAD = 64


class SeqAction(enum.Enum):
    APPLY = "apply"
    SKIP = "skip"
    GAP = "gap"
    RESTART = "restart"
    RANGE_GONE = "range_gone"


class RankSequencer:
    """Where one rank's stream stands: last applied seq and last seq seen live."""

    __slots__ = ("last_applied", "last_live")

    def __init__(self) -> None:
        self.last_applied: int | None = None
        self.last_live: int | None = None

    def reset(self) -> None:
        self.last_applied = None
        self.last_live = None

    def on_live(self, seq: int) -> SeqAction:
        if self.last_live is not None and seq <= self.last_live:
            return SeqAction.RESTART
        self.last_live = seq
        return self._classify(seq)

    def on_replay(self, seq: int) -> SeqAction:
        action = self._classify(seq)
        return SeqAction.RANGE_GONE if action is SeqAction.GAP else action

    def recheck(self, seq: int) -> SeqAction:
        """Classify a live message again after a replay or resync handled its gap."""
        return self._classify(seq)

    def applied(self, seq: int) -> None:
        self.last_applied = seq

    def _classify(self, seq: int) -> SeqAction:
        last = self.last_applied
        if last is None or seq == last + 1:
            return SeqAction.APPLY
        if seq <= last:
            return SeqAction.SKIP
        return SeqAction.GAP


class BlockSizeMismatchError(RuntimeError):
    """The engine publishes blocks of another size than the adapter hashes with."""


class RankNormalizer:
    """Turns one rank's batches into canonical events (through a ``WorkerNormalizer``)."""

    def __init__(self, normalizer: WorkerNormalizer, metrics: AdapterMetrics) -> None:
        self.normalizer = normalizer
        self.metrics = metrics
        worker = normalizer.worker_id
        self._type_counters = {
            name: metrics.engine_events.labels(metrics.engine, worker, name)
            for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
        }
        self._worker = worker
        self._bad_seqs: set[int] = set()

    def publisher_restarted(self) -> None:
        """A new publisher counts from 0 again: seqs seen before mean nothing now."""
        self._bad_seqs.clear()

    def apply(self, seq: int, payload: bytes, out: list[KVEvent]) -> bool:
        """Normalize one batch into ``out``; False when something in it was malformed.

        A malformed event is counted and logged (once per seq) and skipped; the caller
        resyncs. A block size that differs from the adapter's raises
        ``BlockSizeMismatchError``: no resync can fix a misconfiguration.
        """
        try:
            events: list[SgEvent] | list[SgEvent | BadEvent] = decode_batch(payload).events
        except (msgspec.MsgspecError, ValueError, TypeError, RecursionError):
            try:
                _, events, _ = decode_batch_lenient(payload)
            except FrameError as exc:
                self._bad(seq, "frame", str(exc), payload)
                return False
        try:
            return self._apply_events(seq, events, out)
        finally:
            self.normalizer.flush_metrics()

    def _apply_events(
        self, seq: int, events: list[SgEvent] | list[SgEvent | BadEvent], out: list[KVEvent]
    ) -> bool:
        ok = True
        norm = self.normalizer
        stored = removed = cleared = 0
        # Many short chains in one batch: hash their blocks in one vectorized pass.
        short = [
            (i, e)
            for i, e in enumerate(events)
            if isinstance(e, SgBlockStored) and len(e.block_hashes) < SHORT_CHAIN_BLOCKS
        ]
        batched: dict[int, list[int] | None] = {}
        if len(short) > 1:
            locs = norm.short_chain_locals([(len(e.block_hashes), e.token_ids) for _, e in short])
            if locs is not None:
                batched = {i: loc for (i, _), loc in zip(short, locs, strict=True)}
        for index, event in enumerate(events):
            try:
                if isinstance(event, SgBlockStored):
                    stored += 1
                    tier = self._tier(event.medium)
                    if event.block_size != norm.block_size:
                        raise BlockSizeMismatchError(
                            f"SGLang worker {self._worker} published blocks of "
                            f"{event.block_size} tokens but the adapter hashes blocks of "
                            f"{norm.block_size}; start the sidecar with --block-size "
                            f"{event.block_size} (the engine's page_size * dcp_size)"
                        )
                    norm.stored(
                        event.block_hashes,
                        event.parent_block_hash,
                        event.token_ids,
                        tier,
                        out,
                        lora_name=event.lora_name,
                        cache_salt=event.cache_salt,
                        locals_=batched.get(index),
                    )
                elif isinstance(event, SgBlockRemoved):
                    removed += 1
                    norm.removed(event.block_hashes, self._tier(event.medium), out)
                elif isinstance(event, SgAllBlocksCleared):
                    cleared += 1
                    norm.cleared(None, out)
                else:
                    self._bad(seq, "event", event.reason, msgspec.msgpack.encode(event.raw))
                    ok = False
            except MalformedEventError as exc:
                self._bad(seq, "event", str(exc), msgspec.msgpack.encode(event))
                ok = False
        counters = self._type_counters
        for name, n in (
            ("BlockStored", stored),
            ("BlockRemoved", removed),
            ("AllBlocksCleared", cleared),
        ):
            if n:
                counters[name].inc(n)
        return ok

    def _tier(self, medium: str | None) -> Tier:
        tier = tier_of(medium)
        if tier is None:
            raise MalformedEventError(f"unknown storage medium {medium!r}")
        return tier

    def _bad(self, seq: int, kind: str, reason: str, raw: bytes) -> None:
        if seq in self._bad_seqs:
            return  # already counted when first seen (a resync replays it again)
        if len(self._bad_seqs) > 4096:
            self._bad_seqs.clear()
        self._bad_seqs.add(seq)
        self.metrics.decode_errors.labels(self.metrics.engine, self._worker, kind).inc()
        log.error(
            "kv_event_decode_failed",
            worker_id=self._worker,
            seq=seq,
            kind=kind,
            reason=reason,
            raw_len=len(raw),
            raw_head=raw[:_HEAD].hex(),
        )
