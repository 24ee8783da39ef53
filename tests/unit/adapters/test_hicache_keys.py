"""HiCache key mapping and backend settings (no sglang needed)."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest
import xxhash

from adapters.sglang.hicache_config import HiCacheBackendConfig
from adapters.sglang.hicache_keys import HiCacheKeyMap, ShardCoordinates, store_hash_of
from kvcore.namespace import Namespace


@dataclass
class _Info:
    prefix_keys: list[str] | None


def sha_key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_hex_keys_map_to_sglangs_event_hash() -> None:
    """A 64-hex page key's block hash is its first 8 bytes, SGLang's event hash mod 2**64."""
    key = sha_key(b"page")
    expected_signed = int.from_bytes(bytes.fromhex(key[:16]), "big", signed=True)
    keys = HiCacheKeyMap("m")
    assert keys.block_hash(key) == expected_signed % 2**64
    assert keys.block_hash(key.upper()) == keys.block_hash(key)
    assert store_hash_of(expected_signed) == keys.block_hash(key)  # what names store blocks


def test_other_keys_hash_with_the_namespace_seed() -> None:
    """Keys of other schemes are xxh3_64 of their UTF-8 under the namespace seed."""
    keys = HiCacheKeyMap("m")
    key = sha_key(b"x") + "_abc_L0-31"
    assert keys.block_hash(key) == xxhash.xxh3_64_intdigest(key.encode(), seed=keys.namespace_seed)
    assert HiCacheKeyMap("other").block_hash(key) != keys.block_hash(key)


def test_single_shard_uses_the_canonical_model_namespace() -> None:
    """One rank's namespace is the model's canonical seed; other shards get their own."""
    assert HiCacheKeyMap("org/model").namespace_seed == Namespace("org/model").seed
    tp0 = HiCacheKeyMap("org/model", ShardCoordinates(tp_rank=0, tp_size=2))
    tp1 = HiCacheKeyMap("org/model", ShardCoordinates(tp_rank=1, tp_size=2))
    assert len({tp0.namespace_seed, tp1.namespace_seed, Namespace("org/model").seed}) == 3
    packed = struct.pack("<Q6I", Namespace("org/model").seed, 1, 2, 0, 1, 0, 1)
    assert tp1.namespace_seed == xxhash.xxh3_64_intdigest(packed)


def test_rank_replicated_caches_share_one_namespace() -> None:
    """MLA (rank-replicated) pages key the same on every TP rank, as SGLang's file backend."""

    @dataclass
    class Cfg:
        tp_rank: int
        tp_size: int = 4
        is_mla_model: bool = True

    seeds = {HiCacheKeyMap("m", ShardCoordinates.from_storage_config(Cfg(r))).namespace_seed
             for r in range(4)}
    assert seeds == {Namespace("m").seed}


def test_parents_chain_through_prefix_keys() -> None:
    """Each block's parent is the previous key, the first one's the last prefix key."""
    keys = HiCacheKeyMap("m")
    k = [sha_key(bytes([i])) for i in range(4)]
    store = keys.store_keys(k[2:])
    assert keys.parent_hashes(store, _Info(k[:2])) == [keys.block_hash(k[1]), store[0][1]]
    assert keys.parent_hashes(store, None) == [None, store[0][1]]
    assert keys.parent_hashes([], _Info(k)) == []
    assert all(ns == keys.namespace_seed for ns, _ in store)


def test_config_reads_our_keys_and_ignores_sglangs() -> None:
    """extra_config gives the socket and options; SGLang's own keys pass through."""
    cfg = HiCacheBackendConfig.from_extra_config({
        "backend_name": "kvsidecar", "module_path": "adapters.sglang.hicache",
        "class_name": "KvSidecarHiCacheStorage", "interface_v1": 1, "socket": "/run/s.sock",
        "owner_id": "replica-0", "model_id": "org/model", "timeout_s": 2, "retry_interval_s": 0.5,
    })
    assert cfg == HiCacheBackendConfig(Path("/run/s.sock"), "replica-0", "org/model", 2.0, 0.5)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, '"socket"'),
        ({"socket": ""}, '"socket"'),
        ({"socket": "/s", "sockett": 1}, r"unknown extra_config keys \['sockett'\]"),
        ({"socket": "/s", "timeout_s": "5"}, "timeout_s must be a number"),
        ({"socket": "/s", "timeout_s": True}, "timeout_s must be a number"),
        ({"socket": "/s", "timeout_s": 0}, "timeout_s must be positive"),
        ({"socket": "/s", "model_id": ""}, "model_id must be a non-empty string"),
    ],
)
def test_config_refuses_bad_extra_config(extra: dict[str, object], message: str) -> None:
    """Each kind of bad extra_config gets its own message."""
    with pytest.raises(ValueError, match=message):
        HiCacheBackendConfig.from_extra_config(extra)


def test_a_key_that_is_not_a_string_is_refused() -> None:
    """A non-string key is a TypeError (the backend turns it into a counted miss)."""
    with pytest.raises(TypeError, match="a HiCache key is a str, got int"):
        HiCacheKeyMap("m").store_keys([12])  # type: ignore[list-item]
