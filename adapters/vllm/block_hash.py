"""vLLM's prefix-cache block hashes (``vllm/v1/core/kv_cache_utils.py``), recomputed from tokens.

A block's hash is ``H((parent, tuple(block token ids), extra_keys))`` where ``parent`` is the
previous block's hash, or ``NONE_HASH = H(PYTHONHASHSEED)`` (the seed as a string) for a
prompt's first block; ``H`` is the engine's ``--prefix-caching-hash-algo``:

* ``sha256_cbor``: SHA-256 of the input's canonical CBOR (``cbor2.dumps(x, canonical=True)``);
* ``xxhash_cbor``: XXH3-128 of the same CBOR.

The 32-byte (or 16-byte) digest chains; what events carry (``ExternalBlockHash``, with vLLM's
default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) is its low 64 bits, big-endian
(``external_hash``). Consumers that recompute hashes from request tokens (llm-d's indexer)
must be given the same seed as ``PYTHONHASHSEED``.

CBOR is written here for the only shapes the preimage has (arrays, byte and text strings,
unsigned and negative integers, null), in the shortest-form encoding that canonical CBOR
requires, so no CBOR package is needed.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Sequence

import xxhash

__all__ = ["VllmBlockHasher", "VllmHashAlgo", "cbor", "external_hash"]

_MASK = (1 << 64) - 1


class VllmHashAlgo(enum.StrEnum):
    """vLLM's ``--prefix-caching-hash-algo`` values this module reproduces."""

    SHA256_CBOR = "sha256_cbor"
    XXHASH_CBOR = "xxhash_cbor"


def _head(major: int, n: int, out: bytearray) -> None:
    if n < 24:
        out.append(major << 5 | n)
    elif n < 1 << 8:
        out += bytes((major << 5 | 24, n))
    elif n < 1 << 16:
        out.append(major << 5 | 25)
        out += n.to_bytes(2, "big")
    elif n < 1 << 32:
        out.append(major << 5 | 26)
        out += n.to_bytes(4, "big")
    elif n <= _MASK:
        out.append(major << 5 | 27)
        out += n.to_bytes(8, "big")
    else:
        raise ValueError(f"integer {n} does not fit CBOR's 64-bit heads")


def _encode(value: object, out: bytearray) -> None:
    if value is None:
        out.append(0xF6)
    elif isinstance(value, bool):
        out.append(0xF5 if value else 0xF4)
    elif isinstance(value, int):
        if value >= 0:
            _head(0, value, out)
        else:
            _head(1, -1 - value, out)
    elif isinstance(value, bytes):
        _head(2, len(value), out)
        out += value
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        _head(3, len(raw), out)
        out += raw
    elif isinstance(value, tuple | list):
        _head(4, len(value), out)
        for item in value:
            _encode(item, out)
    else:
        raise TypeError(f"cannot CBOR-encode {type(value).__name__}")


def cbor(value: object) -> bytes:
    """``value`` (None, bool, int, bytes, str, tuples/lists of them) as canonical CBOR."""
    out = bytearray()
    _encode(value, out)
    return bytes(out)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


_DIGESTS: dict[VllmHashAlgo, Callable[[bytes], bytes]] = {
    VllmHashAlgo.SHA256_CBOR: _sha256,
    VllmHashAlgo.XXHASH_CBOR: _xxh3_128,
}


def external_hash(digest: bytes) -> int:
    """A block hash as vLLM's events carry it: the digest's low 64 bits, big-endian."""
    return int.from_bytes(digest, "big") & _MASK


class VllmBlockHasher:
    """Chains vLLM block hashes over token ids, as an engine with ``algo`` and
    ``PYTHONHASHSEED=seed`` would."""

    def __init__(self, algo: VllmHashAlgo, block_size: int, seed: str) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.algo = algo
        self.block_size = block_size
        self._digest = _DIGESTS[algo]
        self.none_hash = self._digest(cbor(seed))

    def chain(self, parent: bytes | None, token_ids: Sequence[int]) -> list[bytes]:
        """The digests of the full blocks of ``token_ids`` hanging under ``parent``
        (None: a prompt's first block); a partial last block is left out."""
        bs = self.block_size
        prev = self.none_hash if parent is None else parent
        out = []
        for start in range(0, len(token_ids) - bs + 1, bs):
            prev = self._digest(cbor((prev, tuple(token_ids[start : start + bs]), None)))
            out.append(prev)
        return out
