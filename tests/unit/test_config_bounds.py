"""Every bounded option of every command is held to its range on each way in: the flag, the
``--config`` file, and the config built in code (each config's ``__post_init__`` calls
``check_bounds``); and a flag that two commands share has one range."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcore.options import Bounds, option_bounds
from kvsidecar.indexer import IndexerConfig
from kvsidecar.inject import build_parser as inject_parser
from kvsidecar.inject_options import InjectOptions
from kvsidecar.up_config import UpConfig
from kvsidecar.webhook_config import WebhookConfig
from refengine.config import EngineConfig
from refengine.timing import SimTiming
from replay.config import ReplayConfig
from routing.config import RouterConfig
from routing.epp.config import EppConfig
from routing.flags import gateway_config
from shm.owner.config import OwnerConfig
from sidecar.config import SidecarConfig
from sidecar.transfer.peer_config import BlockPeerConfig
from sidecar.zmq_publisher import ZmqPublishConfig

WORKER = ["--worker", "http://127.0.0.1:9001"]
SHM = ["--owner-id", "o1", "--socket", "/tmp/o1.sock", "--capacity-bytes", "1MiB",
       "--block-bytes", "64KiB"]


def _sidecar(argv: list[str]) -> SidecarConfig:
    return SidecarConfig.from_args(argv, {})


def _blocks(argv: list[str]) -> BlockPeerConfig:
    return BlockPeerConfig.from_args(argv, environ={})


def _inject(argv: list[str]) -> InjectOptions:
    parser = inject_parser()
    return parser.build(InjectOptions, parser.parse_args(argv))


# Each options class: the command that builds it, the flags it needs, and where the built
# command's config holds an instance of the class.
COMMANDS: list[tuple[type, Callable[[list[str]], object], list[str], Callable[[object], object]]]
COMMANDS = [
    (RouterConfig, gateway_config, WORKER, lambda c: c),
    (EppConfig, EppConfig.from_args, WORKER, lambda c: c),
    (SidecarConfig, _sidecar, ["--engine-url", "http://127.0.0.1:30000"], lambda c: c),
    (ZmqPublishConfig, _sidecar, ["--engine-url", "http://127.0.0.1:30000"],
     lambda c: c.zmq_publish),  # type: ignore[attr-defined]
    (EngineConfig, EngineConfig.from_args, [], lambda c: c),
    (SimTiming, EngineConfig.from_args, [], lambda c: c.sim),  # type: ignore[attr-defined]
    (ReplayConfig, ReplayConfig.from_args, ["t.jsonl", "--offline"], lambda c: c),
    (OwnerConfig, OwnerConfig.from_args, SHM, lambda c: c),
    (IndexerConfig, IndexerConfig.from_args, [], lambda c: c),
    (BlockPeerConfig, _blocks, SHM, lambda c: c),
    (WebhookConfig, WebhookConfig.from_args, ["--tls-cert", "c.pem", "--tls-key", "k.pem"],
     lambda c: c),
    (InjectOptions, _inject, ["-f", "pods.yaml"], lambda c: c),
    (UpConfig, UpConfig.from_args, [], lambda c: c),
]
CASES = [pytest.param(cls, build, base, part, name, bounds, id=f"{cls.__name__}.{name}")
         for cls, build, base, part in COMMANDS for name, bounds in option_bounds(cls).items()]


def _outside(bounds: Bounds) -> float:
    """A value just outside ``bounds``: below the lower one where there is one."""
    if bounds.ge is not None:
        return bounds.ge - 1
    if bounds.gt is not None:
        return bounds.gt
    if bounds.le is not None:
        return bounds.le + 1
    assert bounds.lt is not None
    return bounds.lt


@pytest.mark.parametrize(("cls", "build", "base", "part", "name", "bounds"), CASES)
def test_every_bounded_option_is_refused_out_of_range_every_way_in(
    cls: type, build: Callable[[list[str]], object], base: list[str],
    part: Callable[[object], object], name: str, bounds: Bounds, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """In code: ValueError naming the field and its flag; on the command line and in the
    config file: exit 2 naming the flag (or the key) and the same range."""
    bad = _outside(bounds)
    with pytest.raises(ValueError) as info:
        dataclasses.replace(part(build(base)), **{name: bad})  # type: ignore[type-var]
    found = re.fullmatch(rf"{name} (must be .*), got .* \((--[a-z0-9-]+)\)", str(info.value))
    assert found, str(info.value)
    allowed, flag = found.groups()
    capsys.readouterr()

    with pytest.raises(SystemExit) as exit_info:
        build([*base, flag, str(bad)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    # a byte size's flag refuses "-1" before its range can: a size has no sign
    assert f"argument {flag}: {allowed}" in err or f"argument {flag}: '{bad}' is not" in err

    path = tmp_path / "config.toml"
    path.write_text(f"{name} = {bad}\n")
    with pytest.raises(SystemExit):
        build([*base, "--config", str(path)])
    assert f"{path}: {name}: {allowed}" in capsys.readouterr().err


def test_a_flag_that_commands_share_has_one_range() -> None:
    """--port, --block-size, --speedup, --replicas ... are allowed the same values wherever
    they are flags."""
    ranges: dict[str, set[Bounds]] = {}
    for cls, *_ in COMMANDS:
        for name, bounds in option_bounds(cls).items():
            ranges.setdefault(name, set()).add(bounds)
    assert {name: found for name, found in ranges.items() if len(found) > 1} == {}
    assert {"port", "block_size", "speedup", "replicas", "xxh3_seed"} <= ranges.keys()
