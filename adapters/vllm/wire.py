"""vLLM's KV-event wire format (``vllm/distributed/kv_events.py``), decoded.

Framing and replay are the ones SGLang copied (``adapters.zmq_events``): vLLM 0.32 answers a
replay with ``[b"", topic, seq, payload]`` per batch and ``[b"", b"", -1, b""]`` at the end
(older releases left the topic frame out). The payload is a msgpack array
``[ts, events, data_parallel_rank]`` (``EventBatch``: ``array_like=True``); each event is a
msgpack map tagged by ``"type"`` (the class name: ``KVCacheEvent`` is ``tag=True``,
``omit_defaults=True``, not array-like since vLLM 0.10). The structs below mirror vLLM's
fields; unknown extra fields (``locality``, ``ownership``, ...) are ignored, so a newer vLLM
still decodes.

* ``block_hashes`` / ``parent_block_hash`` are ``ExternalBlockHash``: by default
  (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) the low 64 bits, big-endian, of the block's
  hash bytes (``maybe_convert_block_hash`` in ``vllm/v1/core/kv_cache_utils.py``), else the
  bytes themselves. The typed fast path takes integers; the lenient one turns bytes into the
  same integer, so either form keys one block alike.
* ``extra_keys``: per block, what besides the tokens went into its hash (LoRA name,
  multimodal identifiers, the cache salt on a prompt's first block, prompt-embedding hashes);
  ``group_idx`` and ``kv_cache_spec_*``: which KV cache group (hybrid models) the event is of.
* ``medium``: ``"GPU"``, or ``"CPU"`` for the offloading connector's blocks (``tier_of``).

``decode_batch`` is the typed fast path; ``decode_batch_lenient`` (the fallback when the
typed one fails) decodes the batch generically, also accepts the older layouts (a map batch;
array-like events ``[type, field, ...]``) and bytes hashes, and returns every event it
cannot convert as a ``BadEvent`` with the reason.
"""

from __future__ import annotations

from typing import Any

import msgspec

from adapters.zmq_events.framing import BadEvent, FrameError

__all__ = [
    "Batch",
    "VlAllBlocksCleared",
    "VlBlockRemoved",
    "VlBlockStored",
    "VlEvent",
    "decode_batch",
    "decode_batch_lenient",
    "encode_batch",
    "hash_key",
]

_HEAD = 64
_MASK = (1 << 64) - 1


class VlBlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VlBlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class VlAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


VlEvent = VlBlockStored | VlBlockRemoved | VlAllBlocksCleared


class Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[VlEvent]
    data_parallel_rank: int | None = None


# Field order of the array-like events vLLM sent before its events became maps.
_ARRAY_FIELDS = {
    "BlockStored": VlBlockStored.__struct_fields__,
    "BlockRemoved": VlBlockRemoved.__struct_fields__,
    "AllBlocksCleared": (),
}


def hash_key(value: int | bytes) -> int:
    """An ``ExternalBlockHash`` as the integer vLLM publishes by default (its low 64 bits)."""
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & _MASK
    return value


_batch_decoder = msgspec.msgpack.Decoder(Batch)
_batch_encoder = msgspec.msgpack.Encoder()
_any_decoder = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> Batch:
    """The typed fast path; raises ``msgspec.DecodeError``/``ValidationError`` on anything odd."""
    return _batch_decoder.decode(payload)


def encode_batch(ts: float, events: list[VlEvent], rank: int | None) -> bytes:
    """A batch as vLLM's publisher sends it (what ``decode_batch`` reads back)."""
    return _batch_encoder.encode(Batch(ts, events, rank))


def decode_batch_lenient(
    payload: bytes, event_type: Any = VlEvent
) -> tuple[float, list[VlEvent | BadEvent], int | None]:
    """Event-by-event decode; raises ``FrameError`` only if the payload is not a batch.

    ``event_type``: what each event converts to (a union of ``VlEvent``'s types or of their
    subclasses: TensorRT-LLM's, ``adapters.trtllm.push``)."""
    try:
        raw = _any_decoder.decode(payload)
        ts, items, rank = _batch_parts(raw)
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError) as exc:
        raise FrameError(
            f"payload of {len(payload)} bytes is not a vLLM event batch: {exc} "
            f"(head: {payload[:_HEAD].hex()})"
        ) from exc
    return ts, [_event(item, event_type) for item in items], rank


def _batch_parts(raw: Any) -> tuple[float, list[Any], int | None]:
    if isinstance(raw, dict):  # a map batch (EventBatch without array_like)
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or not 2 <= len(raw) <= 3:
        raise ValueError("expected [ts, events, data_parallel_rank]")
    ts, items, rank = (*raw, None)[:3]
    if not isinstance(ts, int | float) or not isinstance(items, list):
        raise ValueError("expected a timestamp and a list of events")
    if rank is not None and not isinstance(rank, int):
        raise ValueError(f"data_parallel_rank {rank!r} is not an integer")
    return float(ts), items, rank


def _event(item: Any, event_type: Any) -> VlEvent | BadEvent:
    if isinstance(item, list) and item and isinstance(item[0], str):
        fields = _ARRAY_FIELDS.get(item[0])
        if fields is None or len(item) - 1 > len(fields):
            return BadEvent(f"unknown array-like event {item[0]!r}", item)
        item = {"type": item[0], **dict(zip(fields, item[1:], strict=False))}
    try:
        if isinstance(item, dict):
            item = _int_hashes(item)
        event: VlEvent = msgspec.convert(item, event_type)
    except (msgspec.ValidationError, TypeError, ValueError) as exc:
        return BadEvent(str(exc), item)
    return event


def _int_hashes(item: dict[str, Any]) -> dict[str, Any]:
    """``item`` with bytes block hashes as vLLM's integer form."""
    hashes, parent = item.get("block_hashes"), item.get("parent_block_hash")
    if isinstance(hashes, list) and any(isinstance(h, bytes) for h in hashes):
        item = {**item, "block_hashes": [hash_key(h) for h in hashes]}
    if isinstance(parent, bytes):
        item = {**item, "parent_block_hash": hash_key(parent)}
    return item
