"""TensorRT-LLM's KV-cache-event JSON (``KVCacheEventSerializer``, ``tensorrt_llm/_utils.py``).

``POST /kv_cache_events`` answers a JSON array of envelopes
``{"event_id", "data", "window_size", "attention_dp_rank"?}`` where ``data.type`` is one of

* ``created``: ``num_blocks_per_cache_level``;
* ``stored``: ``parent_hash`` (u64 or null) and ``blocks`` in chain order, each
  ``{"type": "stored_block", "block_hash", "tokens": [{"type": "unique_token", "token_id",
  "token_extra_id"}], "cache_level", "priority"}`` plus, in newer releases, ``lora_id``,
  ``mm_keys`` and ``cache_salt``;
* ``removed``: ``block_hashes``;
* ``updated``: ``block_hash``, ``cache_level`` and ``priority`` as
  ``{"type": "event_diff", "new_value", "old_value"}`` (either may be null).

Decoding tries the common case first: every token's ``token_extra_id`` is 0, checked by the
decoder itself (``PlainStored``), so the normalizer need not look at each token again; an
answer with a non-zero extra id (multimodal) is decoded again with the general types.

Assumed, not read in a release we could run (TensorRT-LLM cannot be installed here):
``lora_name`` at the ``data`` level (Dynamo reads it), ``lora_id`` per block, and that
``event_id`` counts per attention-DP rank. Unknown extra keys are ignored, so newer fields
decode. The LLM API (``get_kv_cache_events_async``) yields the same objects as dicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

__all__ = [
    "BadEnvelope",
    "Created",
    "Envelope",
    "EventDiff",
    "PlainStored",
    "Removed",
    "Stored",
    "StoredBlock",
    "Token",
    "TrtData",
    "decode_envelopes",
    "envelopes_from_objects",
]

_HEAD = 64


class Token(msgspec.Struct, gc=False):
    token_id: int
    token_extra_id: int = 0


class StoredBlock(msgspec.Struct, gc=False):
    block_hash: int
    tokens: list[Token]
    cache_level: int = 0
    priority: int = 0
    lora_id: int | None = None
    mm_keys: list[Any] = []
    cache_salt: str | None = None


class Created(msgspec.Struct, tag="created", gc=False):
    num_blocks_per_cache_level: list[int] = []


class Stored(msgspec.Struct, tag="stored", gc=False):
    blocks: list[StoredBlock]
    parent_hash: int | None = None
    lora_name: str | None = None
    lora_id: int | None = None


class Removed(msgspec.Struct, tag="removed", gc=False):
    block_hashes: list[int]


class EventDiff(msgspec.Struct, gc=False):
    new_value: int
    old_value: int


class Updated(msgspec.Struct, tag="updated", gc=False):
    block_hash: int
    cache_level: EventDiff | None = None
    priority: EventDiff | None = None


TrtData = Created | Stored | Removed | Updated


class _PlainToken(Token, gc=False):
    token_extra_id: Literal[0] = 0


# The narrower element types make these lists invariant overrides (mypy); reading them as
# the base types is safe, and nothing writes to them.
class _PlainStoredBlock(StoredBlock, gc=False):
    tokens: list[_PlainToken]  # type: ignore[assignment]


class PlainStored(Stored, tag="stored", gc=False):
    """A ``Stored`` whose tokens all have ``token_extra_id`` 0 (checked while decoding)."""

    blocks: list[_PlainStoredBlock]  # type: ignore[assignment]


class Envelope(msgspec.Struct, gc=False):
    event_id: int
    data: TrtData
    window_size: int | None = None
    attention_dp_rank: int | None = None


class _PlainEnvelope(Envelope, gc=False):
    data: Created | PlainStored | Removed | Updated


class _LooseEnvelope(msgspec.Struct, gc=False):
    event_id: int
    data: Any
    window_size: int | None = None
    attention_dp_rank: int | None = None


@dataclass(frozen=True, slots=True)
class BadEnvelope:
    """An envelope whose ``data`` did not decode: its id and rank (if readable), and why."""

    event_id: int | None
    attention_dp_rank: int | None
    reason: str
    raw: bytes


class PayloadError(ValueError):
    """A ``/kv_cache_events`` answer that is not a JSON array of event objects."""


_plain = msgspec.json.Decoder(list[_PlainEnvelope])
_fast = msgspec.json.Decoder(list[Envelope])
_loose = msgspec.json.Decoder(list[Any])
_encode = msgspec.json.encode


def decode_envelopes(payload: bytes) -> list[Envelope | BadEnvelope]:
    """Every envelope of one answer; a bad one becomes ``BadEnvelope`` and loses nothing else.

    Raises ``PayloadError`` only when the payload is not a JSON array at all.
    """
    for decoder in (_plain, _fast):
        try:
            return list(decoder.decode(payload))
        except (msgspec.MsgspecError, ValueError, TypeError, RecursionError):
            pass
    try:
        items = _loose.decode(payload)
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError) as exc:
        raise PayloadError(
            f"kv_cache_events answer of {len(payload)} bytes is not a JSON array: {exc} "
            f"(head: {payload[:_HEAD]!r})"
        ) from exc
    return envelopes_from_objects(items)


def envelopes_from_objects(items: list[Any]) -> list[Envelope | BadEnvelope]:
    """Convert already-parsed event objects (the LLM API's dicts) one by one."""
    out: list[Envelope | BadEnvelope] = []
    for item in items:
        try:
            out.append(msgspec.convert(item, Envelope))
        except (msgspec.ValidationError, TypeError, ValueError) as exc:
            event_id = rank = None
            try:
                loose = msgspec.convert(item, _LooseEnvelope)
                event_id, rank = loose.event_id, loose.attention_dp_rank
            except (msgspec.ValidationError, TypeError, ValueError):
                pass
            try:
                raw = _encode(item)
            except (TypeError, ValueError):
                raw = repr(item).encode()
            out.append(BadEnvelope(event_id, rank, str(exc), raw))
    return out
