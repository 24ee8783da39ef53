"""TensorRT-LLM KV-event JSON, shaped exactly as ``KVCacheEventSerializer`` writes it.

Written from ``tensorrt_llm/_utils.py`` (``_created_to_json``, ``_stored_to_json``,
``_stored_block_to_json``, ``_removed_to_json``, ``_updated_to_json``,
``_event_diff_to_json``, ``_unique_tokens_to_json``; ``to_json_str`` adds
``attention_dp_rank`` only when set). The newer per-block keys ``mm_keys`` and
``cache_salt`` are included when given, as TensorRT-LLM's own KV-event test shows them.
"""

from __future__ import annotations

from typing import Any


def envelope(event_id: int, data: dict, window_size: int = 64, rank: int | None = None) -> dict:
    out: dict[str, Any] = {"event_id": event_id, "data": data, "window_size": window_size}
    if rank is not None:
        out["attention_dp_rank"] = rank
    return out


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


def stored(parent_hash: int | None, blocks: list[dict]) -> dict:
    return {"type": "stored", "parent_hash": parent_hash, "blocks": blocks}


def removed(block_hashes: list[int]) -> dict:
    return {"type": "removed", "block_hashes": block_hashes}


def updated(block_hash: int, level: tuple[int, int] | None, priority: tuple[int, int]) -> dict:
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
