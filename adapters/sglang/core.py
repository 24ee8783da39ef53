"""The pure core of the SGLang subscriber: SGLang's batches → canonical events.

No sockets and no asyncio here; ``adapters.zmq_events.subscriber`` feeds this from ZMQ, and
the sequence rules it applies are ``adapters.zmq_events.sequencer``'s (re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from adapters.normalize import MalformedEventError
from adapters.normalize_hashing import SHORT_CHAIN_BLOCKS
from adapters.sglang.wire import (
    SgAllBlocksCleared,
    SgBlockRemoved,
    SgBlockStored,
    decode_batch,
    decode_batch_lenient,
)
from adapters.zmq_events.batches import BatchNormalizer, BlockSizeMismatchError
from adapters.zmq_events.sequencer import RankSequencer, SeqAction
from kvcore.events import KVEvent

__all__ = ["BlockSizeMismatchError", "RankNormalizer", "RankSequencer", "SeqAction"]


class RankNormalizer(BatchNormalizer):
    """Turns one SGLang rank's batches into canonical events.

    A malformed event is counted and logged (once per seq) and skipped; the caller resyncs.
    A block size that differs from the adapter's raises ``BlockSizeMismatchError``: no
    resync can fix a misconfiguration.
    """

    def _decode(self, payload: bytes) -> Sequence[Any]:
        return decode_batch(payload).events

    def _decode_lenient(self, payload: bytes) -> Sequence[Any]:
        return decode_batch_lenient(payload)[1]

    def _apply_events(self, seq: int, events: Sequence[Any], out: list[KVEvent]) -> bool:
        ok = True
        norm = self.normalizer
        stored = removed = cleared = 0
        # Many short chains in one batch: hash their blocks in one vectorized pass.
        batched = self._short_chain_locals([
            (i, len(e.block_hashes), e.token_ids)
            for i, e in enumerate(events)
            if isinstance(e, SgBlockStored) and len(e.block_hashes) < SHORT_CHAIN_BLOCKS
        ])
        for index, event in enumerate(events):
            try:
                if isinstance(event, SgBlockStored):
                    stored += 1
                    tier = self._tier(event.medium)
                    self._check_block_size(
                        event.block_size, "the engine's page_size * dcp_size"
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
                    self._bad_event(seq, event)
                    ok = False
            except MalformedEventError as exc:
                self._bad(seq, "event", str(exc), msgspec.msgpack.encode(event))
                ok = False
        self._count(stored, removed, cleared)
        return ok
