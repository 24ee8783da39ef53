"""The sidecar's disk- and remote-tier flags: parsed, and refused without what they need."""

from __future__ import annotations

import pytest

from sidecar.config import SidecarConfig

BASE = ["--engine-url", "http://127.0.0.1:30000", "--worker-id", "r0"]


def test_the_disk_tier_flags_parse() -> None:
    cfg = SidecarConfig.from_args([*BASE, "--store-capacity-bytes", "1GiB", "--disk-tier-dir",
                                   "/var/kv", "--disk-tier-capacity-bytes", "64GiB"], {})
    assert (cfg.disk_tier_dir, cfg.disk_tier_capacity_bytes) == ("/var/kv", 64 << 30)
    assert SidecarConfig.from_args(BASE, {}).disk_tier_dir is None


@pytest.mark.parametrize(("extra", "message"), [
    (["--disk-tier-dir", "/var/kv", "--disk-tier-capacity-bytes", "1GiB"],
     "set --store-capacity-bytes too"),
    (["--store-capacity-bytes", "1GiB", "--disk-tier-dir", "/var/kv"], "go together"),
    (["--store-capacity-bytes", "1GiB", "--disk-tier-capacity-bytes", "1GiB"], "go together"),
    (["--store-capacity-bytes", "1GiB", "--disk-tier-dir", "/d", "--disk-tier-capacity-bytes",
      "lots"], "argument --disk-tier-capacity-bytes"),
])
def test_incomplete_disk_tier_flags_are_refused(
        capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    with pytest.raises(SystemExit):
        SidecarConfig.from_args([*BASE, *extra], {})
    assert message in capsys.readouterr().err


def test_the_remote_tier_flags_parse_and_keep_the_password_out_of_the_repr() -> None:
    url = "redis://:s3cret@kv-cache:6379/0"
    cfg = SidecarConfig.from_args([*BASE, "--store-capacity-bytes", "1GiB",
                                   "--remote-tier-url", url, "--remote-tier-write", "evict"], {})
    assert (cfg.remote_tier_url, cfg.remote_tier_write) == (url, "evict")
    assert "s3cret" not in repr(cfg)
    assert SidecarConfig.from_args(BASE, {}).remote_tier_url is None


@pytest.mark.parametrize(("extra", "message"), [
    (["--remote-tier-url", "redis://h:6379"], "set --store-capacity-bytes too"),
    (["--store-capacity-bytes", "1GiB", "--remote-tier-url", "http://h:6379"],
     "redis://, rediss:// or unix://"),
    (["--store-capacity-bytes", "1GiB", "--remote-tier-url", "redis://h", "--remote-tier-write",
      "sometimes"], "argument --remote-tier-write"),
])
def test_bad_remote_tier_flags_are_refused(
        capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    with pytest.raises(SystemExit):
        SidecarConfig.from_args([*BASE, *extra], {})
    assert message in capsys.readouterr().err
