"""The sidecar's disk-tier flags: parsed, and refused without what they need."""

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
