"""SGLang's KV-event schema and recorder, reproduced (``sglang/srt/disaggregation/kv_events.py``
and ``sglang/srt/mem_cache/events.py`` in sglang 0.5.23); sglang itself is not imported.

A batch is a msgpack *array* ``[ts, events, attn_dp_rank]``; each event a msgpack *map* tagged
``"type": <class name>`` whose optional fields are omitted when None. The recorder coalesces
like SGLang's: a BlockStored whose parent is the previous BlockStored's last hash (and whose
medium, salt, ... match) is appended to it; consecutive BlockRemoved of one medium merge.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventRecorder",
    "KVEventBatch",
    "KVEventsConfig",
    "StorageMedium",
]


class StorageMedium(enum.StrEnum):
    GPU = "GPU"
    CPU = "CPU_PINNED"
    DISK = "DISK"
    EXTERNAL = "EXTERNAL"


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events (``tag=True`` puts the class name under ``"type"``)."""


class BlockStored(_KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved(_KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(_KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    attn_dp_rank: int | None = None


class EventRecorder:
    """Collects one scheduler step's events, coalescing them as SGLang's recorder does."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._queue: list[BlockStored | BlockRemoved | AllBlocksCleared] = []

    def stored(
        self,
        hashes: list[int],
        parent: int | None,
        token_ids: list[int],
        block_size: int,
        *,
        cache_salt: str | None,
        medium: StorageMedium = StorageMedium.GPU,
    ) -> None:
        if not self.enabled or not hashes:
            return
        tail = self._queue[-1] if self._queue else None
        if (
            isinstance(tail, BlockStored)
            and tail.medium == medium.value
            and tail.block_size == block_size
            and tail.cache_salt == cache_salt
            and tail.block_hashes
            and parent == tail.block_hashes[-1]
        ):
            tail.block_hashes.extend(hashes)
            tail.token_ids.extend(token_ids)
            return
        self._queue.append(
            BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=parent,
                token_ids=list(token_ids),
                block_size=block_size,
                lora_id=None,
                medium=medium.value,
                cache_salt=cache_salt,
            )
        )

    def removed(self, hashes: list[int], medium: StorageMedium = StorageMedium.GPU) -> None:
        if not self.enabled or not hashes:
            return
        tail = self._queue[-1] if self._queue else None
        if isinstance(tail, BlockRemoved) and tail.medium == medium.value:
            tail.block_hashes.extend(hashes)
            return
        self._queue.append(BlockRemoved(block_hashes=list(hashes), medium=medium.value))

    def cleared(self) -> None:
        if self.enabled:
            self._queue.append(AllBlocksCleared())

    def take(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        out, self._queue = self._queue, []
        return out


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """``--kv-events-config`` JSON, with SGLang's keys and defaults."""

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    bind: bool | None = None
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    format: str = "default"

    def __post_init__(self) -> None:
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv-events publisher must be 'null' or 'zmq', got {self.publisher!r}")
        if self.format != "default":
            raise ValueError(f"kv-events format {self.format!r} is not supported; use 'default'")
        if self.buffer_steps < 1:
            raise ValueError("kv-events buffer_steps must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq"

    @classmethod
    def from_cli(cls, value: str | None) -> KVEventsConfig:
        if not value:
            return cls()
        try:
            raw: Any = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"--kv-events-config has unknown keys: {sorted(unknown)}")
        return cls(**raw)
