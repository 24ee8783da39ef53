"""The pure core of the vLLM adapter: one DP rank's batches → canonical events.

No sockets and no asyncio; ``adapters.zmq_events.subscriber`` feeds it (sequence, replay,
gap and restart rules are the shared ones). What is vLLM's own:

* **Duplicates are counted.** vLLM does not de-duplicate cached blocks
  (``BlockPool.cached_block_hash_to_block`` maps a hash to several block ids): a fully cached
  prompt sent again can fill a fresh block whose hash is already cached, so one hash is
  stored twice and later removed twice. A count per (tier, hash) turns the first of two
  removals into nothing: only the last copy's removal removes the block.
* **Extra keys.** vLLM 0.32 sends ``extra_keys`` on every store, ``None`` for each block
  whose hash took only its tokens. A block whose hash took more (multimodal
  identifiers, prompt embeddings) cannot be hashed canonically from the tokens: it and the
  rest of its chain are skipped (counted ``skipped``). The LoRA name is the event's
  ``lora_name`` (or ``--lora-adapter``'s name of ``lora_id``); on a prompt's first block the
  one key left is its cache salt, which names the canonical namespace.
* **One KV cache group is indexed.** A hybrid model publishes each KV cache group's blocks
  apart (``group_idx``). The first group seen storing full-attention blocks (no
  ``kv_cache_spec_sliding_window``) is indexed; other groups' events are counted
  ``filtered`` and dropped (a block evicted from a sliding window alone changes nothing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from adapters.normalize import MalformedEventError, WorkerNormalizer
from adapters.normalize_hashing import SHORT_CHAIN_BLOCKS
from adapters.normalize_metrics import AdapterMetrics
from adapters.vllm.wire import (
    VlAllBlocksCleared,
    VlBlockRemoved,
    VlBlockStored,
    decode_batch,
    decode_batch_lenient,
)
from adapters.zmq_events.batches import BatchNormalizer
from kvcore.events import KVEvent, Tier

__all__ = ["VllmRankNormalizer"]

_BLOCK_SIZE_HINT = "vLLM's --block-size"


class VllmRankNormalizer(BatchNormalizer):
    """Turns one vLLM DP rank's batches into canonical events."""

    def __init__(
        self,
        normalizer: WorkerNormalizer,
        metrics: AdapterMetrics,
        lora_names: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__(normalizer, metrics)
        self._lora_names = dict(lora_names or {})
        self._copies: dict[Tier, dict[int, int]] = {t: {} for t in Tier}  # copies beyond one
        self._group: int | None = None  # the indexed KV cache group, once one stored

    def publisher_restarted(self) -> None:
        super().publisher_restarted()
        self._group = None

    def _decode(self, payload: bytes) -> Sequence[Any]:
        return decode_batch(payload).events

    def _decode_lenient(self, payload: bytes) -> Sequence[Any]:
        return decode_batch_lenient(payload)[1]

    def _apply_events(self, seq: int, events: Sequence[Any], out: list[KVEvent]) -> bool:
        ok = True
        stored = removed = cleared = 0
        batched = self._short_chain_locals([
            (i, len(e.block_hashes), e.token_ids)
            for i, e in enumerate(events)
            if isinstance(e, VlBlockStored)
            and not _has_extra_keys(e)
            and len(e.block_hashes) < SHORT_CHAIN_BLOCKS
        ])
        for index, event in enumerate(events):
            try:
                if isinstance(event, VlBlockStored):
                    stored += 1
                    self._stored(event, out, batched.get(index))
                elif isinstance(event, VlBlockRemoved):
                    removed += 1
                    self._removed(event, out)
                elif isinstance(event, VlAllBlocksCleared):
                    cleared += 1
                    self._cleared(out)
                else:
                    self._bad_event(seq, event)
                    ok = False
            except MalformedEventError as exc:
                self._bad(seq, "event", str(exc), msgspec.msgpack.encode(event))
                ok = False
        self._count(stored, removed, cleared)
        return ok

    def resync(self, out: list[KVEvent]) -> None:
        super().resync(out)
        self._forget_copies()

    # --- events -------------------------------------------------------------------------------

    def _stored(
        self, event: VlBlockStored, out: list[KVEvent], locals_: list[int] | None
    ) -> None:
        if not self._indexed(event.group_idx, event.kv_cache_spec_sliding_window):
            self.normalizer.count("filtered", len(event.block_hashes))
            return
        tier = self._tier(event.medium)
        self._check_block_size(event.block_size, _BLOCK_SIZE_HINT)
        lora = event.lora_name
        if lora is None and event.lora_id is not None:
            lora = self._lora_names.get(event.lora_id, f"lora-id-{event.lora_id}")
        hashes, tokens, salt = event.block_hashes, event.token_ids, None
        if _has_extra_keys(event):
            plain, salt = _plain_blocks(event, lora)
            if plain < len(hashes):
                self.normalizer.count("skipped", len(hashes) - plain)
                hashes, tokens = hashes[:plain], tokens[: plain * event.block_size]
        copies = self._copies[tier]
        holds = self.normalizer.holds
        for h in hashes:
            if h in copies or holds(h, tier):
                copies[h] = copies.get(h, 0) + 1
        self.normalizer.stored(
            hashes, event.parent_block_hash, tokens, tier, out,
            lora_name=lora, cache_salt=salt, locals_=locals_,
        )

    def _removed(self, event: VlBlockRemoved, out: list[KVEvent]) -> None:
        group = event.group_idx
        if group is not None and self._group is not None and group != self._group:
            self.normalizer.count("filtered", len(event.block_hashes))
            return
        tier = self._tier(event.medium)
        copies = self._copies[tier]
        gone = []
        for h in event.block_hashes:
            n = copies.get(h)
            if n is None:
                gone.append(h)
            elif n > 1:
                copies[h] = n - 1
            else:
                del copies[h]
        self.normalizer.removed(gone, tier, out)

    def _cleared(self, out: list[KVEvent]) -> None:
        self._forget_copies()
        self.normalizer.cleared(None, out)

    def _forget_copies(self) -> None:
        for copies in self._copies.values():
            copies.clear()

    # --- helpers ------------------------------------------------------------------------------

    def _indexed(self, group: int | None, sliding_window: int | None) -> bool:
        if group is None or group == self._group:
            return True
        if self._group is None and sliding_window is None:
            self._group = group
            return True
        return False


def _has_extra_keys(event: VlBlockStored) -> bool:
    """Whether any block's hash took more than its tokens (vLLM 0.32 sends ``[None]`` per
    block when none did)."""
    return event.extra_keys is not None and any(k is not None for k in event.extra_keys)


def _plain_blocks(event: VlBlockStored, lora: str | None) -> tuple[int, str | None]:
    """How many leading blocks of ``event`` hash from their tokens alone (with the LoRA name
    and a first block's cache salt), and that salt."""
    keys = event.extra_keys or []
    salt: str | None = None
    for i, block_keys in enumerate(keys):
        rest = list(block_keys or [])
        if rest and lora is not None and rest[0] == lora:
            rest = rest[1:]
        if not rest:
            continue
        root = i == 0 and event.parent_block_hash is None
        if root and len(rest) == 1 and isinstance(rest[0], str):
            salt = rest[0]
            continue
        return i, salt
    return len(event.block_hashes), salt
