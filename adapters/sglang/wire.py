"""SGLang's KV-event wire format (``sglang/srt/disaggregation/kv_events.py``, 0.5.23), decoded.

A live or replayed message is three frames ``[topic, seq (8 bytes, big-endian), payload]``;
the payload is a msgpack array ``[ts, events, attn_dp_rank]`` whose events are msgpack maps
tagged by ``"type"`` (the class name), optional ``None`` fields omitted. The structs below
mirror SGLang's field for field, so msgspec decodes a batch straight into them (unknown
extra fields are ignored, so a newer SGLang that adds an optional field still decodes).

Two decoders: ``decode_batch`` (typed, the fast path) and ``decode_batch_lenient`` (the
fallback when the typed one fails): it decodes the batch generically, converts event by event,
accepts EAGLE bigram pages (``token_ids`` as ``[t_i, t_i+1]`` pairs) and returns every event
it cannot convert as a ``BadEvent`` with the reason, so one bad event loses nothing else.
"""

from __future__ import annotations

from typing import Any

import msgspec

from adapters.zmq_events.batches import tier_of
from adapters.zmq_events.framing import END_SEQ, BadEvent, FrameError, parse_seq

__all__ = [
    "END_SEQ",
    "BadEvent",
    "Batch",
    "FrameError",
    "SgAllBlocksCleared",
    "SgBlockRemoved",
    "SgBlockStored",
    "SgEvent",
    "decode_batch",
    "decode_batch_lenient",
    "parse_seq",
    "tier_of",
]

_HEAD = 64


class SgBlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SgBlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[int]
    medium: str | None = None


class SgAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


SgEvent = SgBlockStored | SgBlockRemoved | SgAllBlocksCleared


class Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[SgEvent]
    attn_dp_rank: int | None = None


class _BigramStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int | tuple[int, int]] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


_LenientEvent = _BigramStored | SgBlockRemoved | SgAllBlocksCleared


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(Batch)
_raw_decoder = msgspec.msgpack.Decoder(_RawBatch)

def decode_batch(payload: bytes) -> Batch:
    """The typed fast path; raises ``msgspec.DecodeError``/``ValidationError`` on anything odd."""
    return _batch_decoder.decode(payload)


def decode_batch_lenient(payload: bytes) -> tuple[float, list[SgEvent | BadEvent], int | None]:
    """Event-by-event decode; raises ``FrameError`` only if the payload is not a batch."""
    try:
        raw = _raw_decoder.decode(payload)
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError) as exc:
        raise FrameError(
            f"payload of {len(payload)} bytes is not an SGLang event batch: {exc} "
            f"(head: {payload[:_HEAD].hex()})"
        ) from exc
    events: list[SgEvent | BadEvent] = []
    for item in raw.events:
        try:
            event = msgspec.convert(item, _LenientEvent)
        except (msgspec.ValidationError, TypeError, ValueError) as exc:
            events.append(BadEvent(str(exc), item))
            continue
        if isinstance(event, _BigramStored):
            tokens = [t[0] if isinstance(t, tuple) else t for t in event.token_ids]
            event = SgBlockStored(
                event.block_hashes,
                event.parent_block_hash,
                tokens,
                event.block_size,
                event.lora_id,
                event.medium,
                event.cache_salt,
                event.session_id,
                event.lora_name,
            )
        events.append(event)
    return raw.ts, events, raw.attn_dp_rank
