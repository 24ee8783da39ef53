"""shm.owner.config: ``python -m shm``'s flags are ``OwnerConfig``'s fields, with
``--config FILE``."""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from pathlib import Path

import pytest

from shm.owner.config import OwnerConfig, owner_parser
from tests.support.options import config_toml

REQUIRED = ["--owner-id", "o1", "--socket", "/tmp/o1.sock", "--capacity-bytes", "1MiB",
            "--block-bytes", "64KiB"]
BASE = OwnerConfig(owner_id="o1", socket_path=Path("/tmp/o1.sock"), capacity_bytes=1 << 20,
                   block_bytes=64 << 10)
# Every flag given once, each value away from its default; the config the flags make.
EVERY = [*REQUIRED, "--dtype", "float16", "--layout", "page_first", "--worker-id", "w1",
         "--grant-fraction", "0.5", "--ready-file", "/tmp/ready", "--log-level", "debug",
         "--sched-batch", "--disk-tier-dir", "/var/kv", "--disk-tier-capacity-bytes", "1GiB",
         "--remote-tier-url", "redis://cache:6379/0", "--remote-scope", "m",
         "--remote-tier-write", "evict"]
FULL = dataclasses.replace(
    BASE, dtype="float16", layout="page_first", worker_id="w1", grant_fraction=0.5,
    ready_file=Path("/tmp/ready"), log_level="debug", sched_batch=True,
    disk_dir=Path("/var/kv"), disk_capacity_bytes=1 << 30,
    remote_url="redis://cache:6379/0", remote_scope="m", remote_write="evict")
# The spellings before the flags took the sidecar's names.
OLD = {"--disk-dir": "--disk-tier-dir", "--disk-capacity-bytes": "--disk-tier-capacity-bytes",
       "--remote-url": "--remote-tier-url", "--remote-write": "--remote-tier-write"}


def _option_actions() -> list[argparse.Action]:
    return [a for a in owner_parser()._actions if a.dest not in ("help", "config")]


def test_every_flag_is_a_field_and_every_field_a_flag() -> None:
    """One flag per field, its dest the field's name; ``EVERY`` gives each flag."""
    actions = _option_actions()
    fields = sorted(f.name for f in dataclasses.fields(OwnerConfig))
    assert sorted(a.dest for a in actions) == fields
    assert {a.option_strings[0] for a in actions} == {arg for arg in EVERY if arg[:2] == "--"}


def test_defaults_agree_with_the_fields() -> None:
    """A flag left out is the field's default; the required ones have none and are required."""
    assert OwnerConfig.from_args(REQUIRED) == BASE
    for action in _option_actions():
        default = next(f.default for f in dataclasses.fields(OwnerConfig)
                       if f.name == action.dest)
        assert action.required == (default is dataclasses.MISSING), action.dest


def test_every_flag_sets_its_field() -> None:
    assert OwnerConfig.from_args(EVERY) == FULL


def test_the_old_spellings_still_work() -> None:
    """``--disk-dir`` and the others are aliases of the sidecar's spellings, not other flags."""
    old = [next((k for k, v in OLD.items() if v == arg), arg) for arg in EVERY]
    assert old != EVERY
    assert OwnerConfig.from_args(old) == FULL
    text = owner_parser().format_help()
    assert "--disk-tier-dir DIR, --disk-dir DIR" in text
    assert "--remote-tier-url URL, --remote-url URL" in text


def test_a_config_file_round_trips(tmp_path: Path) -> None:
    """Every field written to a TOML file by name reads back as the same config, the
    required ones included; a flag on the command line still wins."""
    path = tmp_path / "shm.toml"
    path.write_text(config_toml(dataclasses.asdict(FULL)))
    assert tomllib.loads(path.read_text())["capacity_bytes"] == 1 << 20
    assert OwnerConfig.from_args(["--config", str(path)]) == FULL
    again = OwnerConfig.from_args(["--config", str(path), "--remote-tier-write", "through"])
    assert again == dataclasses.replace(FULL, remote_write="through")


def test_a_config_file_takes_flag_names_old_spellings_and_sizes(tmp_path: Path) -> None:
    path = tmp_path / "shm.toml"
    path.write_text('owner-id = "o1"\nsocket = "/tmp/o1.sock"\ncapacity-bytes = "1MiB"\n'
                    'block_bytes = 65536\ndisk-dir = "/var/kv"\ndisk-capacity-bytes = "1GiB"\n')
    assert OwnerConfig.from_args(["--config", str(path)]) == dataclasses.replace(
        BASE, disk_dir=Path("/var/kv"), disk_capacity_bytes=1 << 30)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (REQUIRED[2:], "the following arguments are required: --owner-id"),
        ([*REQUIRED, "--capacity-bytes", "2TB"], "argument --capacity-bytes: '2TB' is not a"),
        ([*REQUIRED, "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
        ([*REQUIRED, "--remote-write", "later"], "argument --remote-tier-write/--remote-write"),
        ([*REQUIRED, "--block-bytes", "3", "--dtype", "float16"], "not a whole number"),
        ([*REQUIRED, "--disk-tier-dir", "/var/kv"], "a disk tier needs a capacity"),
    ],
)
def test_bad_flags_exit_2(argv: list[str], message: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        OwnerConfig.from_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
