"""``kvsidecar blocks``' options are BlockPeerConfig's fields: one flag per field, the flags'
old spellings and defaults, and --config FILE (TOML)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvcore.control_token import CONTROL_TOKEN_ENV
from kvcore.logs import LogLevel
from sidecar.transfer.config import TransferConfig
from sidecar.transfer.peer_config import BlockPeerConfig

NOT_FIELDS = {"help", "config"}  # argparse's own, and the file of the fields' values
DERIVED = {"control_token"}  # from --control-token-file or the environment
STORE = ["--owner-id", "peer-a", "--socket", "/tmp/peer-a.sock", "--capacity-bytes", "1MiB",
         "--block-bytes", "4KiB"]


def test_every_flag_is_a_field_and_every_field_a_flag() -> None:
    """One flag per option field; the derived token is no flag."""
    dests = {a.dest for a in BlockPeerConfig.parser()._actions} - NOT_FIELDS
    assert dests == {f.name for f in dataclasses.fields(BlockPeerConfig)} - DERIVED


def test_the_flags_keep_their_spellings_and_defaults() -> None:
    """The flags argparse declared by hand before still parse, to the same defaults."""
    flags = {s for a in BlockPeerConfig.parser()._actions for s in a.option_strings}
    assert flags >= {"--owner-id", "--socket", "--capacity-bytes", "--block-bytes", "--dtype",
                     "--host", "--port", "--tcp-port", "--lease-ttl-s", "--no-nixl",
                     "--control-token-file", "--log-level", "--ready-file"}
    cfg = BlockPeerConfig.from_args(STORE, environ={})
    assert (cfg.dtype, cfg.host, cfg.port, cfg.tcp_port, cfg.lease_ttl_s) == (
        "uint8", "127.0.0.1", 0, 0, 30.0)
    assert (cfg.no_nixl, cfg.control_token_file, cfg.log_level, cfg.ready_file) == (
        False, None, LogLevel.INFO, None)
    assert cfg.owner.capacity_bytes == 1 << 20 and cfg.owner.block_bytes == 4096
    assert cfg.transfer == TransferConfig()


def test_every_flag_sets_its_field(tmp_path: Path) -> None:
    """Each flag reaches the store's and the transfer's configs."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    cfg = BlockPeerConfig.from_args(
        [*STORE, "--dtype", "float16", "--host", "0.0.0.0", "--port", "8100", "--tcp-port",
         "8101", "--lease-ttl-s", "5", "--no-nixl", "--control-token-file", str(token),
         "--log-level", "debug", "--ready-file", str(tmp_path / "ready")], environ={})
    assert cfg.owner.dtype == "float16" and cfg.owner.log_level == "debug"
    assert cfg.transfer == TransferConfig(tcp_host="0.0.0.0", tcp_port=8101, lease_ttl_s=5.0,
                                          enable_nixl=False)
    assert (cfg.port, cfg.control_token, cfg.ready_file) == (8100, "s3cret",
                                                             tmp_path / "ready")


def test_the_token_comes_from_the_environment_without_a_file() -> None:
    """Without --control-token-file the token is KVSIDECAR_CONTROL_TOKEN's (empty: none)."""
    assert BlockPeerConfig.from_args(STORE, environ={CONTROL_TOKEN_ENV: "t"}).control_token == "t"
    assert BlockPeerConfig.from_args(STORE, environ={CONTROL_TOKEN_ENV: ""}).control_token is None


def test_a_config_file_gives_the_options(tmp_path: Path) -> None:
    """--config FILE takes the flags' names; a flag on the command line wins."""
    path = tmp_path / "blocks.toml"
    path.write_text('owner-id = "peer-b"\nsocket = "/tmp/peer-b.sock"\ncapacity_bytes = "2MiB"\n'
                    'block-bytes = 4096\nlease-ttl-s = 2\nno-nixl = true\nlog-level = "warning"\n')
    cfg = BlockPeerConfig.from_args(["--config", str(path), "--lease-ttl-s", "3"], environ={})
    assert (cfg.owner_id, cfg.socket_path, cfg.capacity_bytes) == (
        "peer-b", Path("/tmp/peer-b.sock"), 2 << 20)
    assert (cfg.lease_ttl_s, cfg.no_nixl, cfg.log_level) == (3.0, True, LogLevel.WARNING)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
        (["--lease-ttl-s", "0"], "argument --lease-ttl-s: must be a finite number > 0, got 0.0"),
        (["--capacity-bytes", "1KiB"], "holds no block of 4096 bytes"),
    ],
)
def test_bad_values_are_argparse_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad flag, or a store its sizes cannot make, exits 2 naming the problem."""
    with pytest.raises(SystemExit) as info:
        BlockPeerConfig.from_args([*STORE, *argv], environ={})
    assert info.value.code == 2
    assert message in capsys.readouterr().err
