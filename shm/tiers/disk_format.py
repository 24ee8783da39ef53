"""The disk tier's file format: one file per block, ``<namespace:016x>-<hash:016x>.blk``, a
64-byte header then the block's bytes. Written as ``<name>.tmp`` and renamed into place,
checked on every read. The remote tier's values are the same bytes (``shm.tiers.remote_keys``).

The header: magic ``KVSDISK2``, the store key (namespace, hash), the block's *name*
(``shm.block_names``: its canonical hash and canonical parent, with flags saying whether it
has a name and whether the name has a parent), the block size, and an xxh3-64 of the
payload. So a reader (a restarted owner, another replica) names the block from its header
alone. Files of the first format (``KVSDISK1``: a store parent, no name) read as foreign.
"""

from __future__ import annotations

import struct

import xxhash

from shm.block_names import BlockName

__all__ = [
    "HEADER_BYTES",
    "SUFFIX",
    "TMP_SUFFIX",
    "block_file_name",
    "header_for",
    "header_name",
    "parse_name",
    "problem_of",
]

BlockKey = tuple[int, int]
# magic, namespace, hash, name's hash, name's parent, flags, block_bytes, xxh3-64 of payload
_HEADER = struct.Struct("<8sQQQQQQQ")
HEADER_BYTES = _HEADER.size
_MAGIC = b"KVSDISK2"
_NAMED, _HAS_PARENT = 1, 2
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


def header_for(key: BlockKey, name: BlockName | None, block_bytes: int,
               payload: memoryview) -> bytes:
    flags = 0
    block_hash = parent = 0
    if name is not None:
        flags = _NAMED | (0 if name.parent_hash is None else _HAS_PARENT)
        block_hash, parent = name.block_hash, name.parent_hash or 0
    return _HEADER.pack(_MAGIC, key[0], key[1], block_hash, parent, flags, block_bytes,
                        xxhash.xxh3_64_intdigest(payload))


def header_name(raw: bytes, key: BlockKey, block_bytes: int) -> tuple[bool, BlockName | None]:
    """Whether ``raw`` is a header of this format for ``key``, and the block's name."""
    if len(raw) != HEADER_BYTES:
        return False, None
    magic, ns, h, block_hash, parent, flags, size, _ = _HEADER.unpack(raw)
    if magic != _MAGIC or (ns, h) != key or size != block_bytes:
        return False, None
    if not flags & _NAMED:
        return True, None
    return True, BlockName(block_hash, parent if flags & _HAS_PARENT else None)


def problem_of(
    header: bytearray, key: BlockKey, block_bytes: int, payload: memoryview
) -> str | None:
    """What is wrong with a block read back (None: it is the block written)."""
    magic, ns, h, _, _, _, size, checksum = _HEADER.unpack(header)
    if magic != _MAGIC or (ns, h) != key or size != block_bytes:
        return "header does not match"
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        return "checksum mismatch"
    return None
