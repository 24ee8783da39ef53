"""TensorRT-LLM's KV-cache-event JSON (``KVCacheEventSerializer``, ``tensorrt_llm/_utils.py``).

``POST /kv_cache_events`` answers a JSON array of envelopes
``{"event_id", "data", "window_size", "attention_dp_rank"?, "hash_algo"?, "layer_group_id"?}``
where ``data.type`` is one of

* ``created``: ``num_blocks_per_cache_level``;
* ``stored``: ``parent_hash`` (or null) and ``blocks`` in chain order, each
  ``{"type": "stored_block", "block_hash", "tokens": [{"type": "unique_token", "token_id",
  "token_extra_id"}], "cache_level", "priority"}`` plus, in newer releases, ``lora_id``,
  ``mm_keys`` and ``cache_salt``;
* ``removed``: ``block_hashes``;
* ``updated``: ``block_hash``, ``cache_level`` and ``priority`` as
  ``{"type": "event_diff", "new_value", "old_value"}`` (either may be null).

**Block hashes come in two forms**, named by the envelope's ``hash_algo``
(``kv_cache_config.kv_cache_event_hash_algo``; ``auto`` picks ``v1_block_key`` for the C++
KV cache manager, ``v2_sha256`` for ``use_kv_cache_manager_v2``):

* ``v1_block_key`` (and envelopes without ``hash_algo``, as older releases write them): a
  u64 integer;
* ``v2_sha256_64``: the first 8 bytes of the V2 SHA-256 block key, big-endian, as a u64
  integer;
* ``v2_sha256``: the whole V2 block key as a lowercase hex string (32 bytes: 64 digits).

A hex hash must be an even number of lowercase hex digits, 2 to 128 (a 1–64 byte key), and
a known ``hash_algo`` must match the form of every hash in its envelope; anything else makes
the envelope a ``BadEnvelope`` (a decode error the adapter counts, then a resync), never a
silently dropped or misread block. ``engine_key`` maps either form to the integer the
normalizer keys engine blocks by: integers stay themselves, hex strings go to a tagged range
no u64 reaches, so the two forms never collide. (The canonical block identity never depends
on the engine's hash: the normalizer re-hashes the tokens.)

The V2 manager also writes ``layer_group_id`` (the attention life cycle the event is about:
one stored/removed event per group, the same block hash in each) and may give a token id as
a hex string (a multimodal content digest standing in for a token); the core decides which
group it indexes and skips blocks with such tokens.

Decoding tries the common case first: every token's ``token_extra_id`` is 0 and every token
id an integer, checked by the decoder itself (``PlainStored``), so the normalizer need not
look at each token again; an answer with a non-zero extra id or a digest token (multimodal) is
decoded again with the general types.

Assumed, not read in a release we could run (TensorRT-LLM cannot be installed here):
``lora_name`` at the ``data`` level (Dynamo reads it), ``lora_id`` per block, and that
``event_id`` counts per attention-DP rank. Unknown extra keys are ignored, so newer fields
decode. The LLM API (``get_kv_cache_events_async``) yields the same objects as dicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

__all__ = [
    "HASH_ALGOS",
    "BadEnvelope",
    "Created",
    "EngineHash",
    "Envelope",
    "EventDiff",
    "PlainStored",
    "Removed",
    "Stored",
    "StoredBlock",
    "Token",
    "TrtData",
    "decode_envelopes",
    "engine_key",
    "envelopes_from_objects",
]

_HEAD = 64

# A V2 block key (or a multimodal digest token) as the V2 event manager writes it: bytes.hex().
HexDigest = Annotated[str, msgspec.Meta(pattern="^(?:[0-9a-f]{2}){1,64}$")]
EngineHash = int | HexDigest

# hash_algo → the form its block hashes take on the wire.
HASH_ALGOS: dict[str, type] = {"v1_block_key": int, "v2_sha256_64": int, "v2_sha256": str}

# Hex keys map above every u64 (and above any 128-digit key with its leading 1 nibble).
_HEX_TAG = 1 << 520


def engine_key(block_hash: int | str) -> int:
    """The integer the normalizer keys an engine block by: a u64 hash itself; a hex digest
    ``d`` as ``_HEX_TAG | int("1" + d, 16)`` (the leading 1 keeps leading zeros apart)."""
    if type(block_hash) is int:
        return block_hash
    return _HEX_TAG | int("1" + str(block_hash), 16)


class Token(msgspec.Struct, gc=False):
    token_id: int | HexDigest
    token_extra_id: int = 0


class StoredBlock(msgspec.Struct, gc=False):
    block_hash: EngineHash
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
    parent_hash: EngineHash | None = None
    lora_name: str | None = None
    lora_id: int | None = None


class Removed(msgspec.Struct, tag="removed", gc=False):
    block_hashes: list[EngineHash]


class EventDiff(msgspec.Struct, gc=False):
    new_value: int
    old_value: int


class Updated(msgspec.Struct, tag="updated", gc=False):
    block_hash: EngineHash
    cache_level: EventDiff | None = None
    priority: EventDiff | None = None


TrtData = Created | Stored | Removed | Updated


class _PlainToken(Token, gc=False):
    token_id: int
    token_extra_id: Literal[0] = 0


# The narrower element types make these lists invariant overrides (mypy); reading them as
# the base types is safe, and nothing writes to them.
class _PlainStoredBlock(StoredBlock, gc=False):
    tokens: list[_PlainToken]  # type: ignore[assignment]


class PlainStored(Stored, tag="stored", gc=False):
    """A ``Stored`` whose tokens are all plain: integer ids, ``token_extra_id`` 0 (checked
    while decoding)."""

    blocks: list[_PlainStoredBlock]  # type: ignore[assignment]


def _hashes(data: TrtData) -> list[int | str]:
    if isinstance(data, Stored):
        out: list[int | str] = [b.block_hash for b in data.blocks]
        if data.parent_hash is not None:
            out.append(data.parent_hash)
        return out
    if isinstance(data, Removed):
        return list(data.block_hashes)
    if isinstance(data, Updated):
        return [data.block_hash]
    return []


class Envelope(msgspec.Struct, gc=False):
    event_id: int
    data: TrtData
    window_size: int | None = None
    attention_dp_rank: int | None = None
    hash_algo: str | None = None
    layer_group_id: int | None = None

    def __post_init__(self) -> None:
        # Only a known algorithm is checked: an unknown (newer) one still keys blocks by
        # whatever hash it writes, and the canonical identity comes from the tokens anyway.
        form = HASH_ALGOS.get(self.hash_algo) if self.hash_algo is not None else None
        if form is None:
            return
        for h in _hashes(self.data):
            if type(h) is not form:
                raise ValueError(
                    f"hash_algo {self.hash_algo!r} writes {form.__name__} block hashes, "
                    f"got {h!r}"
                )


class _PlainEnvelope(Envelope, gc=False):
    data: Created | PlainStored | Removed | Updated


class _LooseEnvelope(msgspec.Struct, gc=False):
    event_id: int
    data: Any
    window_size: int | None = None
    attention_dp_rank: int | None = None
    hash_algo: Any = None
    layer_group_id: Any = None


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
