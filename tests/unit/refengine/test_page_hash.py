"""SGLang's page-hash chain, checked against an independent re-derivation and SGLang itself."""

from __future__ import annotations

import hashlib
import struct

import pytest

from refengine.page_hash import (
    event_salt_seed,
    hash_str_to_int64,
    page_digests,
    storage_namespace_seed,
)


def _reference(tokens: list[int], page: int, prior: bytes | None = None) -> list[str]:
    out = []
    for i in range(len(tokens) // page):
        chunk = tokens[i * page : (i + 1) * page]
        data = b"".join(struct.pack("<I", t) for t in chunk)
        prior = hashlib.sha256((prior or b"") + data).digest()
        out.append(prior.hex())
    return out


def test_chain_matches_independent_derivation() -> None:
    """Digests are SHA-256(previous digest ‖ u32-LE tokens), full pages only."""
    tokens = list(range(1000, 1000 + 70))
    assert [d.hex() for d in page_digests(tokens, 16)] == _reference(tokens, 16)
    assert len(page_digests(tokens, 16)) == 4


def test_int64_is_first_eight_bytes_signed_big_endian() -> None:
    """The published hash is the digest's first 8 bytes as a signed big-endian int64."""
    digest = bytes.fromhex("ff" * 8 + "00" * 24)
    assert hash_str_to_int64(digest) == -1
    assert hash_str_to_int64(digest.hex()) == -1
    assert hash_str_to_int64(bytes.fromhex("7f" + "ff" * 7 + "00" * 24)) == 2**63 - 1


def test_salt_seeds_the_event_chain() -> None:
    """A cache_salt seeds the first page with SHA-256('sglang-cache-salt-v1\\0' + salt)."""
    seed = event_salt_seed("tenant-A")
    assert seed == hashlib.sha256(b"sglang-cache-salt-v1\0tenant-A").digest()
    tokens = list(range(32))
    salted = page_digests(tokens, 16, seed)
    assert [d.hex() for d in salted] == _reference(tokens, 16, seed)
    assert salted != page_digests(tokens, 16)
    assert event_salt_seed(None) is None


def test_storage_seed_differs_from_event_seed() -> None:
    """Storage keys of salted requests use SGLang's separate namespace seed."""
    assert storage_namespace_seed(None, None) is None
    assert storage_namespace_seed(None, "s") != event_salt_seed("s")
    assert storage_namespace_seed("a", "bc") != storage_namespace_seed("ab", "c")


def test_wide_tokens_switch_encoding() -> None:
    """A token above u32 hashes the page as 0xff + u64-LE ids."""
    tokens = [2**33, *range(15)]
    expected = hashlib.sha256(b"\xff" + struct.pack("<16Q", *tokens)).hexdigest()
    assert page_digests(tokens, 16)[0].hex() == expected


def test_bad_input_is_rejected() -> None:
    """Negative ids, a zero page size and a short prior raise ValueError."""
    with pytest.raises(ValueError):
        page_digests([-1] * 16, 16)
    with pytest.raises(ValueError):
        page_digests([1], 0)
    with pytest.raises(ValueError):
        page_digests([1] * 16, 16, b"short")


@pytest.mark.sglang
def test_matches_sglang_native_hash() -> None:
    """Our digests equal SGLang's own get_hash_str (its C++ extension, built on first use)."""
    utils = pytest.importorskip("sglang.srt.mem_cache.utils")
    try:
        theirs = utils.get_hash_str(list(range(100, 164)), None, page_size=16)
    except RuntimeError as exc:  # no compiler / OpenSSL headers on this machine
        pytest.skip(f"SGLang's native hash cannot be built here: {exc}")
    assert theirs == [d.hex() for d in page_digests(list(range(100, 164)), 16)]
    salted = utils.get_hash_str(list(range(32)), event_salt_seed("x").hex(), page_size=16)
    assert salted == [d.hex() for d in page_digests(list(range(32)), 16, event_salt_seed("x"))]
    assert utils.hash_str_to_int64(theirs[0]) == hash_str_to_int64(theirs[0])
    assert bytes.fromhex(utils.storage_namespace_seed("k", "s")) == storage_namespace_seed("k", "s")
