"""TensorRT-LLM 1.4's pushed KV events: one ZMQ publisher per attention-DP rank, decoded.

With ``kv_cache_config.kv_events_config`` (``KVEventsConfig(enable_kv_cache_events=True,
publisher="zmq", endpoint=..., replay_endpoint=..., topic=...)``) the V2 KV cache manager's
``StreamingKVCacheEventManager`` (``tensorrt_llm/_torch/pyexecutor/kv_cache_events.py``)
publishes each rank's events itself, with no gather on rank 0 and nothing left for
``/kv_cache_events`` to drain. Rank ``r`` binds the configured ports plus ``r``
(``adapters.zmq_events.endpoints``); the framing, sequence numbers and replay socket are
vLLM's (``adapters.zmq_events``): live ``[topic, seq, payload]``, replayed
``[b"", topic, seq, payload]`` up to a seq of -1.

The payload is vLLM's: a msgpack array ``[ts, events, data_parallel_rank]`` whose events are
maps tagged ``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) with vLLM's
field names, so the vLLM adapter's normalization applies (``VllmRankNormalizer``: medium →
tier, LoRA id → name, KV cache groups, duplicate stores). What TensorRT-LLM adds:

* **Hashes.** ``block_hashes`` and ``parent_block_hash`` are 64-bit integers. The V2 manager
  writes the first 8 bytes of its SHA-256 block key, big-endian, as a *signed* int64
  (``_kv_event_wire_hash_from_radix_key``); a V1 block key is an unsigned u64. Both are
  keyed by their low 64 bits (``h & (2**64 - 1)``), so a V2 key has the same engine key here
  as in the HTTP answer's ``v2_sha256_64`` form. Identity never rests on them: the
  normalizer re-hashes the tokens.
* **Multimodal blocks.** ``token_ids`` may hold strings (a multimodal digest standing in for
  tokens) and ``mm_keys`` names the multimodal segments of each block (one list per block):
  the tokens alone do not identify such a block, so it and the rest of its chain are skipped
  (``blocks{outcome="skipped"}``), as the HTTP path skips them.
* ``created`` and ``updated`` events are not pushed (the streaming manager publishes stored
  and removed blocks of the largest-window layer group only, full blocks only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from adapters.vllm.core import VllmRankNormalizer
from adapters.vllm.wire import (
    VlAllBlocksCleared,
    VlBlockRemoved,
    VlBlockStored,
    decode_batch_lenient,
)
from kvcore.events import KVEvent

__all__ = ["TrtBlockStored", "TrtEvent", "TrtPushRankNormalizer", "decode_push_batch"]

_MASK = (1 << 64) - 1


class TrtBlockStored(VlBlockStored, tag="BlockStored", tag_field="type", gc=False):
    """vLLM's ``BlockStored`` as TensorRT-LLM 1.4 writes it: token ids may be digests
    (strings), and ``mm_keys`` lists each block's multimodal segments."""

    token_ids: list[int | str] = []  # type: ignore[assignment]  # noqa: RUF012
    mm_keys: list[list[Any] | None] | None = None


class _PlainBlockStored(TrtBlockStored, tag="BlockStored", tag_field="type", gc=False):
    """The common case, checked while decoding: every token id an integer."""

    token_ids: list[int] = []  # type: ignore[assignment]  # noqa: RUF012


TrtEvent = TrtBlockStored | VlBlockRemoved | VlAllBlocksCleared


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[TrtEvent]
    data_parallel_rank: int | None = None


class _PlainBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_PlainBlockStored | VlBlockRemoved | VlAllBlocksCleared]
    data_parallel_rank: int | None = None


_plain_decoder = msgspec.msgpack.Decoder(_PlainBatch)
_decoder = msgspec.msgpack.Decoder(_Batch)


def decode_push_batch(payload: bytes) -> tuple[float, Sequence[TrtEvent], int | None]:
    """A typed batch (``ts``, events, rank); ``msgspec`` errors on anything odd."""
    try:
        plain = _plain_decoder.decode(payload)
        return plain.ts, plain.events, plain.data_parallel_rank
    except (msgspec.MsgspecError, ValueError, TypeError):
        batch = _decoder.decode(payload)
        return batch.ts, batch.events, batch.data_parallel_rank


def _u64(hashes: list[int]) -> list[int]:
    return [h & _MASK for h in hashes] if hashes and min(hashes) < 0 else hashes


class TrtPushRankNormalizer(VllmRankNormalizer):
    """One TensorRT-LLM rank's pushed batches → canonical events (vLLM's rules, plus
    TensorRT-LLM's signed hashes and multimodal blocks)."""

    def _decode(self, payload: bytes) -> Sequence[Any]:
        return decode_push_batch(payload)[1]

    def _decode_lenient(self, payload: bytes) -> Sequence[Any]:
        return decode_batch_lenient(payload, TrtEvent)[1]

    def _apply_events(self, seq: int, events: Sequence[Any], out: list[KVEvent]) -> bool:
        kept: list[Any] = []
        dropped = 0
        for event in events:
            if isinstance(event, TrtBlockStored):
                plain = self._plain(event)
                if plain is None:
                    dropped += 1
                    continue
                kept.append(plain)
            elif isinstance(event, VlBlockRemoved):
                hashes = _u64(event.block_hashes)
                kept.append(
                    event if hashes is event.block_hashes
                    else msgspec.structs.replace(event, block_hashes=hashes)
                )
            else:
                kept.append(event)
        self._count(dropped, 0, 0)  # stored events whose every block was skipped
        return super()._apply_events(seq, kept, out)

    def _plain(self, event: TrtBlockStored) -> VlBlockStored | None:
        """``event`` keyed by u64 hashes and cut before its first multimodal block (None:
        nothing left)."""
        hashes, tokens = event.block_hashes, event.token_ids
        n = len(hashes)
        if event.mm_keys or type(event) is not _PlainBlockStored:
            n = _plain_prefix(event)
            if n < len(hashes):
                self.normalizer.count("skipped", len(hashes) - n)
                if n == 0:
                    return None
                hashes, tokens = hashes[:n], tokens[: n * event.block_size]
        keys = _u64(hashes)
        parent = event.parent_block_hash
        if parent is not None:
            parent &= _MASK
        if (
            keys is event.block_hashes
            and tokens is event.token_ids
            and parent == event.parent_block_hash
            and event.mm_keys is None
        ):
            return event
        return msgspec.structs.replace(
            event, block_hashes=keys, parent_block_hash=parent, token_ids=tokens, mm_keys=None
        )


def _plain_blocks(tokens: list[int | str], mm_keys: list[list[Any] | None], n: int, bs: int) -> int:
    for i in range(n):
        if i < len(mm_keys) and mm_keys[i]:
            return i
        if any(type(t) is not int for t in tokens[i * bs : (i + 1) * bs]):
            return i
    return n


def _plain_prefix(event: TrtBlockStored) -> int:
    """How many leading blocks of ``event`` its token ids alone identify."""
    bs = event.block_size
    if bs <= 0:
        return len(event.block_hashes)  # the block-size check refuses the event
    return _plain_blocks(event.token_ids, event.mm_keys or [], len(event.block_hashes), bs)
