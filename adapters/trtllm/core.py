"""The pure core of the TensorRT-LLM adapter: one attention-DP rank's envelopes → canonical.

TensorRT-LLM has no replay, so its stream rules are simpler than SGLang's and every loss
ends in a resync (new epoch, ``AllBlocksCleared``, then rebuild from the events that follow):

* ``event_id`` must grow by one per envelope (one ``KVCacheEventManager`` per attention-DP
  rank, one counter each); a jump is a **gap** (the engine's ``event_buffer_max_size``
  overflowed, or another poller drained events) → resync;
* ``event_id`` at or below the last one, or a ``created`` event after other events, is a
  **restart** → resync;
* a malformed envelope is counted, logged and → resync.

Normalization: ``cache_level`` 0 → GPU, 1 → HOST (each block carries its own level, so a
stored chain is split where levels change); ``updated`` with a ``cache_level`` diff moves the
block between tiers; blocks with a non-zero ``token_extra_id`` or ``mm_keys`` (multimodal:
the tokens alone do not identify the content) and partial blocks are skipped; with several
attention window sizes (VSWA) only the largest window's events are kept, as Dynamo does.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import structlog

from adapters.normalize import MalformedEventError, WorkerNormalizer
from adapters.normalize_metrics import AdapterMetrics
from adapters.trtllm.wire import (
    BadEnvelope,
    Created,
    Envelope,
    PlainStored,
    Removed,
    Stored,
)
from kvcore.events import KVEvent, Tier

__all__ = ["Prepared", "TrtRankCore", "tier_of_level"]

log = structlog.get_logger(component="adapters.trtllm")

_HEAD = 64
_LEVEL_TIERS = {0: Tier.GPU, 1: Tier.HOST, 2: Tier.DISK}

# A stored envelope's token ids (every block's, flattened) and block locals (or None).
Prepared = tuple[list[int], list[int] | None]


def tier_of_level(level: int) -> Tier | None:
    return _LEVEL_TIERS.get(level)


class TrtRankCore:
    """Sequencing and normalization of one rank's envelopes."""

    def __init__(
        self,
        normalizer: WorkerNormalizer,
        metrics: AdapterMetrics,
        lora_names: Mapping[int, str] | None = None,
    ) -> None:
        self.normalizer = normalizer
        self.metrics = metrics
        self._lora_names = dict(lora_names or {})
        self._worker = normalizer.worker_id
        self.last_event_id: int | None = None
        self._non_created_seen = False
        self._max_window: int | None = None
        engine, worker = metrics.engine, self._worker
        self._types = {
            name: metrics.engine_events.labels(engine, worker, name)
            for name in ("created", "stored", "removed", "updated")
        }
        self._pending_types = dict.fromkeys(self._types, 0)

    def flush_metrics(self) -> None:
        """Push the counts gathered since the last flush (once per answer, not per event)."""
        for name, n in self._pending_types.items():
            if n:
                self._types[name].inc(n)
                self._pending_types[name] = 0
        self.normalizer.flush_metrics()

    def apply(
        self, env: Envelope | BadEnvelope, out: list[KVEvent], prepared: Prepared | None = None
    ) -> None:
        """Apply one envelope (in order); resyncs itself when the stream broke.

        ``prepared``: for a stored envelope, the token ids of all its blocks (flattened) and
        their precomputed block locals, if any (see ``normalize_hashing``), gathered for the
        whole answer at once.
        """
        if isinstance(env, BadEnvelope):
            self._bad("envelope", env.reason, env.raw)
            if env.event_id is not None:
                self.last_event_id = env.event_id
            self.resync("malformed_event", out)
            return
        data = env.data
        eid = env.event_id
        last = self.last_event_id
        if last is not None and eid <= last:
            self.resync("event_id_reset", out)
        elif isinstance(data, Created) and self._non_created_seen:
            self.resync("engine_recreated", out)
        elif last is not None and eid > last + 1:
            self.metrics.gaps.labels(self.metrics.engine, self._worker).inc()
            log.warning("kv_event_gap_detected", worker_id=self._worker, expected=last + 1, got=eid)
            self.resync("event_gap", out)
        self.last_event_id = eid
        if isinstance(data, Created):
            self._pending_types["created"] += 1
            if env.window_size is not None:
                self._max_window = max(self._max_window or 0, env.window_size)
            return
        self._non_created_seen = True
        window = env.window_size
        if window is not None:
            if self._max_window is None or window > self._max_window:
                self._max_window = window
            elif window < self._max_window:
                self._filtered(data)
                return
        try:
            if isinstance(data, Stored):
                self._pending_types["stored"] += 1
                self._stored(data, out, prepared)
            elif isinstance(data, Removed):
                self._pending_types["removed"] += 1
                self.normalizer.removed(data.block_hashes, None, out)
            else:
                self._pending_types["updated"] += 1
                diff = data.cache_level
                if diff is not None and diff.new_value != diff.old_value:
                    src, dst = tier_of_level(diff.old_value), tier_of_level(diff.new_value)
                    if src is None or dst is None:
                        raise MalformedEventError(f"unknown cache level in {diff!r}")
                    self.normalizer.moved(data.block_hash, src, dst, out)
        except MalformedEventError as exc:
            self._bad("event", str(exc), msgspec.json.encode(env))
            self.resync("malformed_event", out)

    def _stored(self, data: Stored, out: list[KVEvent], prepared: Prepared | None) -> None:
        blocks = data.blocks
        if prepared is None:
            ids = [t.token_id for b in blocks for t in b.tokens]
            locals_ = None
        else:
            ids, locals_ = prepared
        lora = data.lora_name
        if lora is None and data.lora_id is not None:
            lora = self._lora_names.get(data.lora_id, f"lora-id-{data.lora_id}")
        norm = self.normalizer
        if len(blocks) == 1:
            # The common case of a decode step: no runs to split.
            block = blocks[0]
            tier = _LEVEL_TIERS.get(block.cache_level)
            if tier is None:
                raise MalformedEventError(f"unknown cache_level {block.cache_level}")
            if block.mm_keys or (
                type(data) is not PlainStored and any([t.token_extra_id for t in block.tokens])
            ):
                self._skipped(1)
                return
            norm.stored(
                [block.block_hash],
                data.parent_hash,
                ids,
                tier,
                out,
                lora_name=lora,
                cache_salt=block.cache_salt,
                locals_=locals_,
            )
            return
        # Consecutive blocks sharing a level and a salt become one canonical event; a run
        # is blocks[first:end], its token ids ids[tok_first:tok_end].
        parent = data.parent_hash
        extra = type(data) is not PlainStored and any(
            [t.token_extra_id for b in blocks for t in b.tokens]
        )
        first = end = tok_first = tok_end = 0
        run_tier = Tier.GPU
        run_salt: str | None = None

        def flush() -> None:
            whole = tok_first == 0 and tok_end == len(ids)
            norm.stored(
                [b.block_hash for b in blocks[first:end]],
                parent,
                ids if whole else ids[tok_first:tok_end],
                run_tier,
                out,
                lora_name=lora,
                cache_salt=run_salt,
                locals_=locals_ if locals_ is None or first == 0 else locals_[first:],
            )

        bs = norm.block_size
        for i, block in enumerate(blocks):
            tier = _LEVEL_TIERS.get(block.cache_level)
            if tier is None:
                raise MalformedEventError(f"unknown cache_level {block.cache_level}")
            toks = block.tokens
            plain = not block.mm_keys and not (extra and any([t.token_extra_id for t in toks]))
            if end > first and (not plain or tier is not run_tier or block.cache_salt != run_salt):
                flush()
                parent = blocks[end - 1].block_hash
                first, tok_first = end, tok_end
            if not plain:
                # Multimodal or extra-id tokens: this block and its children cannot be hashed.
                self._skipped(len(blocks) - i)
                return
            count = len(toks)
            end, tok_end = i + 1, tok_end + count
            run_tier, run_salt = tier, block.cache_salt
            if count != bs:
                # A partial block ends the chain (the normalizer skips it); anything after it
                # would hang under a block nobody publishes.
                self._skipped(len(blocks) - end)
                break
        if end > first:
            flush()

    def resync(self, reason: str, out: list[KVEvent]) -> None:
        """Start over: ``AllBlocksCleared`` now, rebuild from what follows."""
        self.metrics.resyncs.labels(self.metrics.engine, self._worker, reason).inc()
        log.warning("kv_worker_resynced", worker_id=self._worker, reason=reason)
        self.normalizer.resync(out)
        self._non_created_seen = False
        if reason in ("event_id_reset", "engine_recreated"):
            self._max_window = None

    def _filtered(self, data: object) -> None:
        self.normalizer.count("filtered", len(data.blocks) if isinstance(data, Stored) else 1)

    def _skipped(self, n: int) -> None:
        if n:
            self.normalizer.count("skipped", n)

    def _bad(self, kind: str, reason: str, raw: bytes) -> None:
        self.metrics.decode_errors.labels(self.metrics.engine, self._worker, kind).inc()
        log.error(
            "kv_event_decode_failed",
            worker_id=self._worker,
            kind=kind,
            reason=reason,
            raw_len=len(raw),
            raw_head=raw[:_HEAD].hex(),
        )
