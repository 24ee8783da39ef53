"""SGLang HiCache page keys → the block store's ``(namespace_seed, block_hash)`` keys.

SGLang names each page by a string: the 64-hex SHA-256 of the page's tokens chained from
the previous page (``get_hash_str``), or, under other key schemes, a longer string. The
mapping is deterministic, so any process that sees the same key finds the same block:

* ``namespace_seed``: ``Namespace(model_id).seed`` (the canonical model namespace,
  ``kvcore.namespace``) when the engine runs one shard (TP = PP = CP = 1, or a
  rank-replicated MLA cache); otherwise ``xxh3_64`` of that seed and the shard coordinates
  ``(tp_rank, tp_size, pp_rank, pp_size, cp_rank, cp_size)``, little-endian, so ranks that
  hold different heads or layers of the same page never share a block.
* ``block_hash``: for a 64-hex key, its first 16 hex digits read as an unsigned 64-bit
  integer. That is exactly SGLang's published KV-event hash of the page (``hash_str_to_int64``,
  modulo 2**64: ``store_hash_of``), so the sidecar names the store's blocks canonically from
  the engine's own events (``shm.block_names``). Any other key: ``xxh3_64(key as UTF-8,
  seed=namespace_seed)``, which no event names.

A page's parent is the previous key of the same call, or the last of
``extra_info.prefix_keys`` for the first one (SGLang passes the chain before the batch).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvcore.namespace import namespace_seed

__all__ = ["HiCacheKeyMap", "ShardCoordinates", "store_hash_of"]

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_SHARD = struct.Struct("<Q6I")
_U64 = (1 << 64) - 1


def store_hash_of(event_hash: int) -> int:
    """The store hash of a page whose SGLang KV event hash is ``event_hash`` (its digest's
    first 8 bytes, read signed there and unsigned here)."""
    return event_hash & _U64


@dataclass(frozen=True, slots=True)
class ShardCoordinates:
    """Which slice of every page this engine rank holds."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1

    @property
    def whole(self) -> bool:
        return (self.tp_size, self.pp_size, self.cp_size) == (1, 1, 1)

    @classmethod
    def from_storage_config(cls, config: Any) -> ShardCoordinates:
        """From SGLang's ``HiCacheStorageConfig`` (or the reference engine's twin).

        A rank-replicated cache (``is_mla_model``: every TP rank holds the whole page) keys
        its pages without the TP coordinates, as SGLang's own file backend does.
        """
        replicated = bool(getattr(config, "is_mla_model", False))
        return cls(
            tp_rank=0 if replicated else int(getattr(config, "tp_rank", 0)),
            tp_size=1 if replicated else int(getattr(config, "tp_size", 1)),
            pp_rank=int(getattr(config, "pp_rank", 0)),
            pp_size=int(getattr(config, "pp_size", 1)),
            cp_rank=int(getattr(config, "attn_cp_rank", 0)),
            cp_size=int(getattr(config, "attn_cp_size", 1)),
        )


@dataclass(frozen=True, slots=True)
class HiCacheKeyMap:
    """Maps SGLang's string page keys to store keys for one model and shard."""

    model_id: str
    shard: ShardCoordinates = ShardCoordinates()
    namespace_seed: int = field(init=False)

    def __post_init__(self) -> None:
        seed = namespace_seed(self.model_id)
        if not self.shard.whole:
            s = self.shard
            seed = xxhash.xxh3_64_intdigest(
                _SHARD.pack(seed, s.tp_rank, s.tp_size, s.pp_rank, s.pp_size, s.cp_rank,
                            s.cp_size))
        object.__setattr__(self, "namespace_seed", seed)

    def block_hash(self, key: str) -> int:
        if not isinstance(key, str):
            raise TypeError(f"a HiCache key is a str, got {type(key).__name__}")
        if len(key) == 64 and _HEX64.fullmatch(key):
            return int(key[:16], 16)
        return xxhash.xxh3_64_intdigest(key.encode("utf-8"), seed=self.namespace_seed)

    def store_keys(self, keys: Sequence[str]) -> list[tuple[int, int]]:
        seed = self.namespace_seed
        block_hash = self.block_hash
        return [(seed, block_hash(k)) for k in keys]

    def parent_hashes(
        self, store_keys: Sequence[tuple[int, int]], extra_info: Any = None
    ) -> list[int | None]:
        """Each block's predecessor in the chain (None when SGLang did not say)."""
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        first = self.block_hash(prefix[-1]) if prefix else None
        return [first, *(k[1] for k in store_keys[:-1])] if store_keys else []
