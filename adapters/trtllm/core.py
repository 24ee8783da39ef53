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
block between tiers; blocks with a non-zero ``token_extra_id``, a digest token id or
``mm_keys`` (multimodal: the tokens alone do not identify the content) and partial blocks are
skipped. Engine hashes of either wire form become normalizer keys through
``wire.engine_key``.

**One group is indexed.** An engine with several attention window sizes (VSWA) reports each
window's blocks apart (``window_size``), and the V2 KV cache manager reports each layer group
(``layer_group_id``: one attention life cycle, e.g. the full-attention layers and each
sliding window) apart, the same block under the same hash in every group it is stored in. A
prefix is reusable as far as the full-attention KV reaches, so one group is indexed: the one
with the largest window, the lowest ``layer_group_id`` among equals (as Dynamo keeps the
largest window). The other groups' events are counted (blocks ``filtered``) and dropped, so
a block evicted from a sliding-window group alone changes nothing. The choice is made from
the ``created`` events each group opens with; if events reveal a better group only after
blocks of another were published, that is a resync (``indexed_group_changed``): the old
group's blocks could never be removed again. Once a stream names layer groups, an event
without one is about the whole block (every group) and always applies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

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
    StoredBlock,
    Token,
    engine_key,
)
from kvcore.events import KVEvent, Tier

__all__ = ["Prepared", "TrtRankCore", "tier_of_level", "token_ids"]

log = structlog.get_logger(component="adapters.trtllm")

_HEAD = 64
_LEVEL_TIERS = {0: Tier.GPU, 1: Tier.HOST, 2: Tier.DISK}

# A stored envelope's token ids (every block's, flattened) and block locals (or None).
Prepared = tuple[list[int], list[int] | None]

# Which events a rank indexes: (window_size, layer_group_id) of one group.
Group = tuple[int | None, int | None]


def tier_of_level(level: int) -> Tier | None:
    return _LEVEL_TIERS.get(level)


def token_ids(blocks: list[StoredBlock]) -> list[int]:
    """Every block's token ids, flattened. A digest token (a hex string) is listed as it is:
    its block is skipped (``_opaque``), so its id never reaches the normalizer."""
    return cast(list[int], [t.token_id for b in blocks for t in b.tokens])


def _keys(hashes: list[int | str]) -> list[int]:
    """Normalizer keys of engine hashes (integers, the common case, as they are)."""
    return [h if type(h) is int else engine_key(h) for h in hashes]


def _opaque(tokens: list[Token]) -> bool:
    """Whether tokens hide content the ids alone do not name (extra ids, digest tokens)."""
    return any([t.token_extra_id or type(t.token_id) is not int for t in tokens])


def _better(group: Group, than: Group) -> bool:
    """Whether ``group`` is the one to index over ``than``: a larger window, or the same
    window and a lower layer group id."""
    window, other_window = group[0] or 0, than[0] or 0
    if window != other_window:
        return window > other_window
    return (group[1] or 0) < (than[1] or 0)


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
        self._indexed: Group | None = None  # the group whose events are kept
        self._grouped = False  # the stream names layer groups (the V2 manager)
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
        group: Group = (env.window_size, env.layer_group_id)
        if isinstance(data, Created):
            self._pending_types["created"] += 1
            self._select(group, out, publishing=False)
            return
        self._non_created_seen = True
        if group != self._indexed and not self._select(group, out, publishing=True):
            self._filtered(data)
            return
        try:
            if isinstance(data, Stored):
                self._pending_types["stored"] += 1
                self._stored(data, out, prepared)
            elif isinstance(data, Removed):
                self._pending_types["removed"] += 1
                self.normalizer.removed(_keys(data.block_hashes), None, out)
            else:
                self._pending_types["updated"] += 1
                diff = data.cache_level
                if diff is not None and diff.new_value != diff.old_value:
                    src, dst = tier_of_level(diff.old_value), tier_of_level(diff.new_value)
                    if src is None or dst is None:
                        raise MalformedEventError(f"unknown cache level in {diff!r}")
                    self.normalizer.moved(engine_key(data.block_hash), src, dst, out)
        except MalformedEventError as exc:
            self._bad("event", str(exc), msgspec.json.encode(env))
            self.resync("malformed_event", out)

    def _stored(self, data: Stored, out: list[KVEvent], prepared: Prepared | None) -> None:
        blocks = data.blocks
        if prepared is None:
            ids = token_ids(blocks)
            locals_ = None
        else:
            ids, locals_ = prepared
        parent = None if data.parent_hash is None else engine_key(data.parent_hash)
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
            if block.mm_keys or (type(data) is not PlainStored and _opaque(block.tokens)):
                self._skipped(1)
                return
            h = block.block_hash
            norm.stored(
                [h if type(h) is int else engine_key(h)],
                parent,
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
        extra = type(data) is not PlainStored and any([_opaque(b.tokens) for b in blocks])
        first = end = tok_first = tok_end = 0
        run_tier = Tier.GPU
        run_salt: str | None = None

        def flush() -> None:
            whole = tok_first == 0 and tok_end == len(ids)
            norm.stored(
                _keys([b.block_hash for b in blocks[first:end]]),
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
            plain = not block.mm_keys and not (extra and _opaque(toks))
            if end > first and (not plain or tier is not run_tier or block.cache_salt != run_salt):
                flush()
                parent = engine_key(blocks[end - 1].block_hash)
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
            self._indexed = None
            self._grouped = False

    def _select(self, group: Group, out: list[KVEvent], *, publishing: bool) -> bool:
        """Whether events of ``group`` are indexed; a better group becomes the indexed one
        (a resync when blocks of the old one were published)."""
        indexed = self._indexed
        window, layer_group = group
        if layer_group is None:
            if self._grouped or window is None:
                # An event of no group in a grouped stream is about the whole block (all its
                # groups); without windows there is nothing to choose.
                return True
        else:
            self._grouped = True
            if indexed is not None and indexed[1] is None:
                indexed = None  # windows alone chose so far: groups choose from now on
        if group == indexed:
            return True
        if indexed is None or _better(group, indexed):
            self._indexed = group
            if publishing and indexed is not None and self.normalizer.num_blocks():
                self.resync("indexed_group_changed", out)
                self._non_created_seen = True
            return True
        return False

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
