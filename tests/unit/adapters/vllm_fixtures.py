"""vLLM's KV event structs as ``vllm/distributed/kv_events.py`` declares them (field for field,
with its struct options), to encode frames exactly as vLLM does (tests only)."""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class LegacyBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Before vLLM's events became maps: every struct array-like."""

    ts: float
    events: list[Any]


class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyBlockRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


def stored(
    hashes: list[int | bytes], parent: int | bytes | None, tokens: list[int], bs: int,
    **extra: Any,
) -> BlockStored:
    fields: dict[str, Any] = {"lora_id": None, "medium": "GPU", "lora_name": None, **extra}
    return BlockStored(hashes, parent, tokens, bs, **fields)


def batch(*events: KVCacheEvent, rank: int | None = 0) -> bytes:
    return msgspec.msgpack.encode(EventBatch(1.5, list(events), rank))
