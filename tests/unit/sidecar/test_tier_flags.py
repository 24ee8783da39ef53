"""The sidecar's store and disk- and remote-tier flags: parsed, and refused without what
they need; the store's geometry and block names follow the engine's hook."""

from __future__ import annotations

import pytest

from kvcore.layout import LayoutKind
from sidecar.config import SidecarConfig
from sidecar.host_tier import store_geometry, store_names
from tests.unit.adapters.fake_adapter import FakeAdapter

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


def test_the_store_layout_is_the_engine_hooks_unless_given() -> None:
    """Without --store-layout the store takes the layout the engine's hook writes (the
    adapter's); with --store-block-bytes alone, raw; the flag wins over both."""
    adapter = FakeAdapter(block_size=16)
    model = adapter.block_layout()
    cfg = SidecarConfig.from_args([*BASE, "--store-capacity-bytes", "1GiB"], {})
    assert cfg.store_layout is None
    assert store_geometry(cfg, adapter) == (model.bytes_per_block, "float32", model.kind)
    cfg = SidecarConfig.from_args([*BASE, "--store-capacity-bytes", "1GiB",
                                   "--store-layout", "page_first"], {})
    assert store_geometry(cfg, adapter) == (
        model.bytes_per_block, "float32", LayoutKind.PAGE_FIRST)
    cfg = SidecarConfig.from_args([*BASE, "--store-capacity-bytes", "1GiB",
                                   "--store-block-bytes", "32KiB"], {})
    assert store_geometry(cfg, adapter) == (32 << 10, "uint8", LayoutKind.RAW)


def test_an_unknown_store_layout_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """--store-layout takes the layouts of kvcore.layout and names them when refusing."""
    with pytest.raises(SystemExit):
        SidecarConfig.from_args([*BASE, "--store-layout", "sideways"], {})
    err = capsys.readouterr().err
    assert "argument --store-layout" in err and "layer_first,page_first,raw" in err


def test_the_store_names_blocks_as_the_engine_hook_keys_them() -> None:
    """An engine whose hook keys blocks by its own hashes gets a store that learns their
    names from the adapter; a canonically keyed one, names by key; no store, no names."""
    cfg = SidecarConfig.from_args([*BASE, "--store-capacity-bytes", "1GiB"], {})
    names = store_names(cfg, FakeAdapter())
    assert names is not None and names.canonical_keys
    assert store_names(SidecarConfig.from_args(BASE, {}), FakeAdapter()) is None
