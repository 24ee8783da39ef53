"""API keys → tenants: the key file's format, lookups by digest, reloads, tenant salts."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from routing.serve.auth import ApiKeys, parse_key_file, tenant_salt
from routing.serve.rate_limit import RateLimits


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _bearer(key: str) -> dict[bytes, bytes]:
    return {b"authorization": b"Bearer " + key.encode()}


def _keys(tmp_path: Path, text: str, clock: Clock | None = None) -> ApiKeys:
    path = tmp_path / "keys"
    path.write_text(text)
    return ApiKeys(path, RateLimits(), b"", clock or Clock())


def test_clear_and_hashed_keys_name_their_tenants(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"sk-bob").hexdigest()
    keys = _keys(tmp_path, f"# clients\nsk-alice alice\n\nsha256:{digest} bob  # hashed\n")
    alice = keys.authenticate(_bearer("sk-alice"))
    bob = keys.authenticate({b"x-api-key": b"sk-bob"})
    assert alice is not None and alice.name == "alice"
    assert bob is not None and bob.name == "bob"
    assert keys.tenants == ["alice", "bob"]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {b"authorization": b"Bearer sk-wrong"},
        {b"authorization": b"Bearer "},
        {b"authorization": b"Basic c2stYWxpY2U="},
        {b"authorization": b"sk-alice"},  # no scheme
        {b"x-api-key": b"sk-alicE"},
    ],
)
def test_a_missing_or_wrong_key_names_no_tenant(
    tmp_path: Path, headers: dict[bytes, bytes]
) -> None:
    assert _keys(tmp_path, "sk-alice alice\n").authenticate(headers) is None


def test_two_keys_of_one_tenant_share_it(tmp_path: Path) -> None:
    keys = _keys(tmp_path, "k1 team\nk2 team\n")
    assert keys.authenticate(_bearer("k1")) is keys.authenticate(_bearer("k2"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "lists no key"),
        ("lonely\n", "expected 'KEY TENANT"),
        ("sha256:abc t\n", "64 hex digits"),
        ("k t\nk u\n", "listed twice"),
        ("k t rps=fast\n", "rps must be a number"),
        ("k t rps=0\n", "rps must be a finite number > 0"),
        ("k t burst=3\n", "unknown column"),
        ("k t weight=-1\n", "weight must be a finite number > 0"),
        ("k bad'tenant\n", "tenant"),
    ],
)
def test_a_malformed_file_says_which_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_key_file(text, "keys")


def test_per_tenant_columns_override_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("k1 small rps=2 tps=50\nk2 big\n")
    keys = ApiKeys(path, RateLimits(10.0, 1000.0))
    small, big = keys.authenticate(_bearer("k1")), keys.authenticate(_bearer("k2"))
    assert small is not None and big is not None
    assert small.buckets.limits == RateLimits(2.0, 50.0)
    assert big.buckets.limits == RateLimits(10.0, 1000.0)


def test_a_tenants_weight_is_its_share_of_a_busy_fleet(tmp_path: Path) -> None:
    keys = _keys(tmp_path, "k1 gold weight=3\nk2 gold\nk3 plain\n")
    gold, plain = keys.authenticate(_bearer("k2")), keys.authenticate(_bearer("k3"))
    assert gold is not None and plain is not None
    assert (gold.weight, plain.weight) == (3.0, 1.0)  # one line gives it, for every key
    with pytest.raises(ValueError, match="tenant 'gold' is given two weights, 3 and 2"):
        _keys(tmp_path, "k1 gold weight=3\nk2 gold weight=2\n")


def test_the_file_is_reloaded_when_it_changes_at_most_once_a_second(tmp_path: Path) -> None:
    clock = Clock()
    keys = _keys(tmp_path, "old alice\n", clock)
    assert keys.authenticate(_bearer("old")) is not None  # the first check: nothing changed
    tmp = tmp_path / "keys.new"
    tmp.write_text("new alice\n")
    os.replace(tmp, tmp_path / "keys")  # a new inode, as an atomic rewrite makes
    clock.now += 0.5
    assert keys.authenticate(_bearer("old")) is not None  # not checked again within a second
    clock.now += 0.6
    assert keys.authenticate(_bearer("old")) is None
    assert keys.authenticate(_bearer("new")) is not None
    assert keys.reloads == 1


def test_a_broken_rewrite_keeps_the_keys_loaded_before(tmp_path: Path) -> None:
    clock = Clock()
    keys = _keys(tmp_path, "k alice\n", clock)
    (tmp_path / "keys").write_text("k alice\nhalf-written-line\n")
    clock.now += 2
    assert keys.authenticate(_bearer("k")) is not None
    (tmp_path / "keys").write_text("k2 alice\n")
    clock.now += 2
    assert keys.authenticate(_bearer("k")) is None
    assert keys.authenticate(_bearer("k2")) is not None


def test_a_tenant_keeps_its_buckets_across_a_reload(tmp_path: Path) -> None:
    clock = Clock()
    keys = _keys(tmp_path, "k alice\n", clock)
    before = keys.authenticate(_bearer("k"))
    (tmp_path / "keys").write_text("k alice\nk2 bob\n")
    clock.now += 2
    assert keys.authenticate(_bearer("k")) is before


def test_salts_differ_per_tenant_and_secret_and_hold_no_colon() -> None:
    salts = {tenant_salt(s, t) for s in (b"", b"secret") for t in ("alice", "bob")}
    assert len(salts) == 4
    assert all(len(s) == 32 and ":" not in s for s in salts)
    assert tenant_salt(b"x", "alice") == tenant_salt(b"x", "alice")  # stable across gateways
