"""The disk tier's file format: one file per block, ``<namespace:016x>-<hash:016x>.blk``, a
56-byte header (magic, key, parent hash, block size, xxh3-64 of the payload) then the block's
bytes. Written as ``<name>.tmp`` and renamed into place, checked on every read."""

from __future__ import annotations

import struct

import xxhash

__all__ = [
    "HEADER_BYTES",
    "SUFFIX",
    "TMP_SUFFIX",
    "block_file_name",
    "header_for",
    "header_parent",
    "parse_name",
    "problem_of",
]

BlockKey = tuple[int, int]
# magic, namespace, hash, parent hash, has a parent (0/1), block_bytes, xxh3-64 of the payload
_HEADER = struct.Struct("<8sQQQQQQ")
HEADER_BYTES = _HEADER.size
_MAGIC = b"KVSDISK1"
SUFFIX = ".blk"
TMP_SUFFIX = ".tmp"


def block_file_name(key: BlockKey) -> str:
    return f"{key[0]:016x}-{key[1]:016x}{SUFFIX}"


def parse_name(name: str) -> BlockKey | None:
    """The key a block file's name holds (None: not a block file's name)."""
    stem = name[: -len(SUFFIX)]
    ns, sep, h = stem.partition("-")
    if not sep or len(ns) != 16 or len(h) != 16:
        return None
    try:
        return int(ns, 16), int(h, 16)
    except ValueError:
        return None


def header_for(key: BlockKey, parent: int | None, block_bytes: int, payload: memoryview) -> bytes:
    return _HEADER.pack(_MAGIC, key[0], key[1], parent or 0, parent is not None, block_bytes,
                        xxhash.xxh3_64_intdigest(payload))


def header_parent(raw: bytes, key: BlockKey, block_bytes: int) -> tuple[bool, int | None]:
    """Whether ``raw`` is a header of this format for ``key``, and the block's parent."""
    if len(raw) != HEADER_BYTES:
        return False, None
    magic, ns, h, parent, has_parent, size, _ = _HEADER.unpack(raw)
    ok = magic == _MAGIC and (ns, h) == key and size == block_bytes
    return ok, parent if has_parent else None


def problem_of(
    header: bytearray, key: BlockKey, block_bytes: int, payload: memoryview
) -> str | None:
    """What is wrong with a block read back (None: it is the block written)."""
    magic, ns, h, _, _, size, checksum = _HEADER.unpack(header)
    if magic != _MAGIC or (ns, h) != key or size != block_bytes:
        return "header does not match"
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        return "checksum mismatch"
    return None
