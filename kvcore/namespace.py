"""Namespaces: which cache a block hash belongs to.

Identical tokens under another model, LoRA adapter or tenant salt must never share a block
hash, so the namespace is folded into the chain's seed (``S_{-1}`` in ``hashing.py``). An
empty adapter or salt means "none", as in Dynamo and SGLang.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from functools import lru_cache

import xxhash

__all__ = ["Namespace", "namespace_seed"]

_SEED_DOMAIN = b"kvsidecar.namespace.v1"


def _field(value: str | None) -> bytes:
    if not value:
        return b"\x00"
    raw = value.encode("utf-8")
    return b"\x01" + struct.pack("<I", len(raw)) + raw


@dataclass(frozen=True, slots=True)
class Namespace:
    """(model id, LoRA adapter, tenant salt) → the 64-bit seed of every hash chain in it."""

    model_id: str
    lora_name: str | None = None
    cache_salt: str | None = None
    seed: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("a namespace needs a non-empty model id")
        encoded = (
            _SEED_DOMAIN + _field(self.model_id) + _field(self.lora_name) + _field(self.cache_salt)
        )
        object.__setattr__(self, "seed", xxhash.xxh3_64_intdigest(encoded))


@lru_cache(maxsize=4096)
def namespace_seed(
    model_id: str, lora_name: str | None = None, cache_salt: str | None = None
) -> int:
    """``Namespace(model_id, lora_name, cache_salt).seed``, memoised: every process hashes
    under the same few namespaces again and again (bounded: a tenant salt per request
    cannot grow it without limit)."""
    return Namespace(model_id, lora_name or None, cache_salt or None).seed
