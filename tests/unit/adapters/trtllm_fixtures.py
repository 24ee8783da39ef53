"""TensorRT-LLM KV-event JSON, shaped exactly as ``KVCacheEventSerializer`` writes it.

Written from ``tensorrt_llm/_utils.py`` (``_created_to_json``, ``_stored_to_json``,
``_stored_block_to_json``, ``_removed_to_json``, ``_updated_to_json``,
``_event_diff_to_json``, ``_unique_tokens_to_json``; ``to_json_str`` adds
``attention_dp_rank`` only when set). The newer per-block keys ``mm_keys`` and
``cache_salt`` are included when given, as TensorRT-LLM's own KV-event test shows them.

The V2 KV cache manager's events (``runtime/kv_cache_manager_v2/_event_manager.py`` and its
tests, ``test_v2_kv_cache_event_manager_*``) add ``hash_algo`` and ``layer_group_id`` to
every envelope; under ``v2_sha256`` block hashes are the SHA-256 block key's ``bytes.hex()``
(``v2_key``: ``sha256(parent key || tokens as little-endian u32)``, the root key
``sha256`` of the empty reuse scope's one mask byte), under ``v2_sha256_64`` its first 8
bytes read big-endian (``truncate_sha256_hash_to_int64``). Stored blocks carry
``"mm_keys": []``; a multimodal digest token is its ``bytes.hex()``.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

V2_ROOT = hashlib.sha256(b"\x00").digest()  # reuse_scope_to_bytes(ReuseScope()) == b"\x00"


def envelope(
    event_id: int,
    data: dict,
    window_size: int = 64,
    rank: int | None = None,
    *,
    hash_algo: str | None = None,
    layer_group_id: int | None = None,
) -> dict:
    out: dict[str, Any] = {"event_id": event_id, "data": data, "window_size": window_size}
    if rank is not None:
        out["attention_dp_rank"] = rank
    if hash_algo is not None:
        out["hash_algo"] = hash_algo
        out["layer_group_id"] = layer_group_id
    return out


def v2_key(parent: bytes, tokens: list[int]) -> bytes:
    """A V2 block key: SHA-256 over the parent's key and the tokens as little-endian u32."""
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}I", *tokens)).digest()


def v2_chain(tokens: list[int], block_size: int) -> list[bytes]:
    """The V2 keys of every full block of ``tokens`` under the root."""
    keys, parent = [], V2_ROOT
    for i in range(0, len(tokens) - len(tokens) % block_size, block_size):
        parent = v2_key(parent, tokens[i : i + block_size])
        keys.append(parent)
    return keys


def sha256_64(key: bytes) -> int:
    """``truncate_sha256_hash_to_int64``: the key's first 8 bytes, big-endian, unsigned."""
    return int.from_bytes(key[:8], "big", signed=False)


def v2_block(block_hash: str | int, tokens: list[int | str], *, cache_level: int = 0,
             priority: int = 35) -> dict:
    """A stored block as the V2 manager serializes it (``mm_keys`` always present)."""
    return {
        "type": "stored_block",
        "block_hash": block_hash,
        "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens],
        "cache_level": cache_level,
        "priority": priority,
        "mm_keys": [],
        "cache_salt": None,
    }


def created(levels: list[int] | None = None) -> dict:
    return {"type": "created", "num_blocks_per_cache_level": levels or [1024, 0]}


def block(
    block_hash: int,
    tokens: list[int],
    *,
    cache_level: int = 0,
    priority: int = 35,
    extra_ids: list[int] | None = None,
    mm_keys: list[dict] | None = None,
    cache_salt: str | None = None,
) -> dict:
    extra = extra_ids or [0] * len(tokens)
    out: dict[str, Any] = {
        "type": "stored_block",
        "block_hash": block_hash,
        "tokens": [
            {"type": "unique_token", "token_id": t, "token_extra_id": e}
            for t, e in zip(tokens, extra, strict=True)
        ],
        "cache_level": cache_level,
        "priority": priority,
    }
    if mm_keys is not None:
        out["mm_keys"] = mm_keys
    if cache_salt is not None or mm_keys is not None:
        out["cache_salt"] = cache_salt
    return out


def stored(parent_hash: int | str | None, blocks: list[dict]) -> dict:
    return {"type": "stored", "parent_hash": parent_hash, "blocks": blocks}


def removed(block_hashes: list[int] | list[str]) -> dict:
    return {"type": "removed", "block_hashes": block_hashes}


def updated(
    block_hash: int | str, level: tuple[int, int] | None, priority: tuple[int, int] | None
) -> dict:
    def diff(values: tuple[int, int] | None) -> dict | None:
        if values is None:
            return None
        return {"type": "event_diff", "new_value": values[1], "old_value": values[0]}

    return {
        "type": "updated",
        "block_hash": block_hash,
        "cache_level": diff(level),
        "priority": diff(priority),
    }
