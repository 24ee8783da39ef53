"""SGLang's page hashes, reproduced byte for byte (``sglang/srt/mem_cache/utils.py`` and
``cpp_utils/hash_binding.cpp`` in sglang 0.5.23).

``digest_i = SHA-256(digest_{i-1} ‖ tokens of page i as uint32 little-endian)``; the first page
has no prior digest unless a namespace seeds it. A page with any token id above ``2**32 - 1``
is hashed in the *wide* form: the byte ``0xff`` then the ids as uint64 little-endian. The
64-hex digest is the HiCache storage key; the published event hash is its first 8 bytes read
big-endian as a signed int64.

Two seeds exist for salted requests and they differ on purpose, as in SGLang:

* events: ``SHA-256(b"sglang-cache-salt-v1\\0" + salt)`` (:func:`event_salt_seed`);
* storage keys: ``SHA-256("sglang-cache-namespace-v1", presence/length-prefixed extra_key and
  salt)`` (:func:`storage_namespace_seed`).

A request's storage keys are its chain of page digests (:func:`extend_storage_keys`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refengine.request import Request

__all__ = [
    "event_salt_seed",
    "extend_storage_keys",
    "hash_str_to_int64",
    "page_digests",
    "storage_namespace_seed",
]

_U32_MAX = 0xFFFFFFFF


def _page_bytes(tokens: Sequence[int], wide: bool) -> bytes:
    """``wide``: some id of the page is beyond 32 bits (64-bit ids, marked)."""
    if wide and max(tokens) > _U32_MAX:
        return b"\xff" + struct.pack(f"<{len(tokens)}Q", *tokens)
    return struct.pack(f"<{len(tokens)}I", *tokens)


def page_digests(
    token_ids: Sequence[int], page_size: int, prior: bytes | None = None
) -> list[bytes]:
    """32-byte digests of every *full* page of ``token_ids``, chained from ``prior``."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if prior is not None and len(prior) != 32:
        raise ValueError("prior digest must be exactly 32 bytes")
    out: list[bytes] = []
    full = token_ids[: len(token_ids) // page_size * page_size]
    if not full:
        return out
    if min(full) < 0:  # checked once, not per page
        raise ValueError("token ids must be non-negative")
    wide = max(full) > _U32_MAX
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        h.update(_page_bytes(token_ids[start : start + page_size], wide))
        prior = h.digest()
        out.append(prior)
    return out


def hash_str_to_int64(digest: bytes | str) -> int:
    """The published event hash of a page: the digest's first 8 bytes as big-endian int64."""
    raw = bytes.fromhex(digest[:16]) if isinstance(digest, str) else digest[:8]
    return int.from_bytes(raw, "big", signed=True)


def event_salt_seed(cache_salt: str | None) -> bytes | None:
    """The prior digest of a salted request's first page in the *event* chain."""
    if cache_salt is None:
        return None
    return hashlib.sha256(b"sglang-cache-salt-v1\0" + cache_salt.encode("utf-8")).digest()


def storage_namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """The prior digest of the first page in the *storage key* chain (HiCache L3 keys)."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.digest()


def extend_storage_keys(req: Request, upto_pages: int, page_size: int) -> list[str]:
    """The request's HiCache keys for its first ``upto_pages`` full pages (computed lazily).

    Unsalted requests reuse the event digests (the two chains coincide, as in SGLang); salted
    ones hash a separate chain seeded by ``storage_namespace_seed``.
    """
    have = len(req.storage_keys)
    if upto_pages > have:
        if req.cache_salt is None and len(req.digests) >= upto_pages:
            req.storage_keys.extend(d.hex() for d in req.digests[have:upto_pages])
        else:
            tokens = req.all_tokens()[have * page_size : upto_pages * page_size]
            prior = (
                bytes.fromhex(req.storage_keys[-1])
                if have
                else storage_namespace_seed(None, req.cache_salt)
            )
            req.storage_keys.extend(d.hex() for d in page_digests(tokens, page_size, prior))
    return req.storage_keys[:upto_pages]
