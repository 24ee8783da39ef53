"""The remote tier's names and values in a Redis-protocol store.

A block is one string value under ``kvsidecar:<scope>:<namespace:016x><hash:016x>``: the
``scope`` (the model and its block size, see ``RemoteKeys``) keeps models and layouts apart
in one store, the namespace keeps tenants and LoRA adapters apart within a model. The value is
the disk tier's file (``shm.tiers.disk_format``: a 64-byte header with the key, the block's
canonical name, the block size and an xxh3-64 of the payload, then the payload), so a reader
checks what it got and learns the block's name from the header alone (``GETRANGE`` of 64
bytes): a replica names a block another one wrote without having seen its tokens.

What the store holds is followed through its keyspace notifications (``notify-keyspace-events``
with ``K`` for the keyspace channel, ``$`` for ``set``, ``g`` for ``del``, ``x`` for expiry and
``e`` for eviction under ``maxmemory``): ``KEYSPACE_EVENTS``.
"""

from __future__ import annotations

import re

import numpy as np

from shm.block_names import BlockName
from shm.tiers.disk_format import HEADER_BYTES, header_for, header_name, problem_of

__all__ = [
    "BATCH_BYTES",
    "KEYSPACE_EVENTS",
    "RemoteKeys",
    "check_value",
    "pack_value",
    "value_name",
]

BlockKey = tuple[int, int]
KEYSPACE_EVENTS = "K$gxe"
BATCH_BYTES = 32 << 20  # the values one store call carries at most: an MGET, a pipeline of SETs
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


class RemoteKeys:
    """Key names of one scope (``<model>:<block_bytes>``) and the channels that name them."""

    def __init__(self, model_id: str, block_bytes: int, db: int = 0) -> None:
        self.prefix = f"kvsidecar:{model_id}:{block_bytes}:".encode()
        self._channel = f"__keyspace@{db}__:".encode() + self.prefix
        glob_prefix = _GLOB_SPECIAL.sub(r"\\\1", self.prefix.decode())
        self.match = f"{glob_prefix}*"  # SCAN ... MATCH
        self.channel_pattern = f"__keyspace@{db}__:{glob_prefix}*"  # PSUBSCRIBE

    def name(self, key: BlockKey) -> bytes:
        return self.prefix + f"{key[0]:016x}{key[1]:016x}".encode()

    def key_of(self, name: bytes) -> BlockKey | None:
        """The block key a name of this scope holds (None: not one of ours)."""
        if not name.startswith(self.prefix):
            return None
        return _parse_hex(name[len(self.prefix):])

    def key_of_channel(self, channel: bytes) -> BlockKey | None:
        """The block key a keyspace notification's channel names (None: not ours)."""
        if not channel.startswith(self._channel):
            return None
        return _parse_hex(channel[len(self._channel):])


def _parse_hex(tail: bytes) -> BlockKey | None:
    if len(tail) != 32:
        return None
    try:
        return int(tail[:16], 16), int(tail[16:], 16)
    except ValueError:
        return None


def pack_value(key: BlockKey, name: BlockName | None, payload: np.ndarray) -> bytes:
    """The stored value of a block: header, then its bytes (one copy)."""
    view = payload.data.cast("B")
    return b"".join((header_for(key, name, len(view), view), view))


def value_name(head: bytes, key: BlockKey,
               block_bytes: int) -> tuple[bool, BlockName | None]:
    """Whether ``head`` (a value's first bytes) is a block value for ``key``; its name."""
    return header_name(bytes(head[:HEADER_BYTES]), key, block_bytes)


def check_value(value: bytes, key: BlockKey, block_bytes: int, dst: np.ndarray) -> str | None:
    """Copy a stored value's payload into ``dst`` after checking it: None, or the problem."""
    if len(value) != HEADER_BYTES + block_bytes:
        return f"{len(value)} bytes, expected {HEADER_BYTES + block_bytes}"
    view = memoryview(value)
    payload = view[HEADER_BYTES:]
    problem = problem_of(bytearray(view[:HEADER_BYTES]), key, block_bytes, payload)
    if problem is None:
        np.copyto(dst, np.frombuffer(payload, np.uint8))  # dst: one uint8 row
    return problem
