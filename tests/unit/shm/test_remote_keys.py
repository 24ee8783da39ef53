"""The remote tier's key names, channels and values (``shm.tiers.remote_keys``), its URL redaction
and the message when its extra is missing."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from shm.block_names import BlockName
from shm.tiers.disk_format import HEADER_BYTES
from shm.tiers.remote_keys import RemoteKeys, check_value, pack_value, value_name
from shm.tiers.remote_tier import _redacted, load_redis


def test_names_round_trip_and_stay_in_their_scope() -> None:
    keys = RemoteKeys("qwen[3]*", 4096, db=2)
    name = keys.name((7, 2**64 - 1))
    assert name == b"kvsidecar:qwen[3]*:4096:0000000000000007ffffffffffffffff"
    assert keys.key_of(name) == (7, 2**64 - 1)
    assert keys.key_of_channel(b"__keyspace@2__:" + name) == (7, 2**64 - 1)
    assert keys.key_of(RemoteKeys("qwen[3]*", 8192).name((7, 1))) is None  # another layout
    assert keys.key_of_channel(b"__keyspace@0__:" + name) is None  # another database
    assert keys.key_of(name[:-1] + b"g") is None
    # Glob characters of the model name are escaped in SCAN MATCH and PSUBSCRIBE patterns.
    assert keys.match == r"kvsidecar:qwen\[3\]\*:4096:*"
    assert keys.channel_pattern == r"__keyspace@2__:kvsidecar:qwen\[3\]\*:4096:*"


def test_a_value_carries_its_name_and_is_checked() -> None:
    """A value's header names the block canonically (or not at all); its payload is checked."""
    payload = np.arange(256, dtype=np.uint8)
    value = pack_value((1, 2), BlockName(2**64 - 1, 99), payload)
    assert len(value) == HEADER_BYTES + 256
    assert value_name(value[:HEADER_BYTES], (1, 2), 256) == (True, BlockName(2**64 - 1, 99))
    assert value_name(value[:HEADER_BYTES], (1, 3), 256)[0] is False
    assert value_name(pack_value((1, 2), BlockName(5, None), payload), (1, 2), 256) == (
        True, BlockName(5, None))
    assert value_name(pack_value((1, 2), None, payload), (1, 2), 256) == (True, None)
    dst = np.zeros(256, np.uint8)
    assert check_value(value, (1, 2), 256, dst) is None and (dst == payload).all()
    torn = bytearray(value)
    torn[-1] ^= 1
    assert check_value(bytes(torn), (1, 2), 256, dst) == "checksum mismatch"
    assert check_value(value, (1, 3), 256, dst) == "header does not match"
    assert check_value(value[:-1], (1, 2), 256, dst) == f"{HEADER_BYTES + 255} bytes, expected " \
        f"{HEADER_BYTES + 256}"


def test_a_password_never_reaches_a_log_line() -> None:
    assert _redacted("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert _redacted("rediss://user:s3cret@h:6379") == "rediss://user:***@h:6379"
    assert _redacted("redis://h:6379") == "redis://h:6379"


def test_without_the_extra_the_error_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis.asyncio", None)
    with pytest.raises(ImportError, match=r"kvsidecar\[remote-tier\]"):
        load_redis()
