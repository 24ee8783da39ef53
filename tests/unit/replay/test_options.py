"""Replay's options are ReplayConfig's fields: one flag per field (the trace files are the
positional arguments), the same defaults, --config FILE, and one of --offline / --url."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from refengine.config import EngineConfig
from refengine.timing import SimTiming, TimingModel
from replay.config import ReplayConfig, build_parser
from routing.config import RouterConfig, RouterMode
from tests.support.options import as_flag_default, refusal

NOT_OPTIONS = {"help", "config", "traces"}
# The options: ReplayConfig's fields but the traces and sim, whose own fields are --sim-*.
OPTIONS = [f for cls in (ReplayConfig, SimTiming) for f in dataclasses.fields(cls)
           if f.name not in ("traces", "sim")]


def _option_actions() -> list[argparse.Action]:
    return [a for a in build_parser()._actions if a.dest not in NOT_OPTIONS]


def test_every_flag_is_a_field_and_every_field_a_flag() -> None:
    assert {a.dest for a in _option_actions()} == {f.name for f in OPTIONS}


def test_the_flags_defaults_are_the_fields() -> None:
    actions = {a.dest: a for a in _option_actions()}
    for f in OPTIONS:
        assert actions[f.name].default == as_flag_default(f.default), f.name
    cfg = ReplayConfig.from_args(["t.jsonl", "--offline"])
    assert cfg == ReplayConfig(traces=("t.jsonl",), offline=True)
    assert cfg.fleet(4096).timing == TimingModel()
    assert cfg.chosen_policies == (list(RouterMode), True)


def test_a_config_file_sets_the_options(tmp_path: Path) -> None:
    """Keys are flag or field names; --policy's list; a flag on the command line wins."""
    path = tmp_path / "replay.toml"
    path.write_text('offline = true\nreplicas = 4\ncapacity-share = 0.2\n'
                    'policy = ["kv", "oracle"]\nsim_decode_base_ms = 4\n')
    cfg = ReplayConfig.from_args(["a.jsonl", "b.csv", "--config", str(path), "--replicas", "2"])
    assert (cfg.traces, cfg.replicas, cfg.capacity_share) == (("a.jsonl", "b.csv"), 2, 0.2)
    assert cfg.chosen_policies == ([RouterMode.KV], True)
    assert cfg.fleet(4096).timing.decode_base_s == 0.004


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["t.jsonl"], "one of the arguments --offline --url is required"),
        (["t.jsonl", "--offline", "--url", "http://h:1"], "not allowed with argument --offline"),
        (["t.jsonl", "--offline", "--policy", "best"], "argument --policy: invalid choice"),
        (["t.jsonl", "--offline", "--limit", "0"], "argument --limit: must be >= 1, got 0"),
    ],
)
def test_bad_flags_exit_2(argv: list[str], message: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    assert message in refusal(lambda: ReplayConfig.from_args(argv), capsys)


def test_the_router_and_engine_options_are_the_gateways_and_the_engines() -> None:
    """The replicas' and the router's flags are the reference engine's and the gateway's
    (declared there, ``option_of``): the same flags and defaults, but the weights, which a
    replay fixes where the gateway learns them."""
    fixed = {"overlap_weight": 1.0, "prefill_load_scale": 1.0}
    for source, names in (
        (EngineConfig, ("page_size", "chunked_prefill_size", "max_running_requests")),
        (RouterConfig, ("router_temperature", "approx_ttl_s", "block_size", *fixed)),
    ):
        theirs = {f.name: f for f in dataclasses.fields(source)}
        ours = {f.name: f for f in dataclasses.fields(ReplayConfig)}
        for name in names:
            mine, other = ours[name].metadata["kvcore.option"], theirs[name].metadata[
                "kvcore.option"]
            assert (mine.flag, mine.aliases, mine.parse) == (other.flag, other.aliases,
                                                             other.parse), name
            assert ours[name].default == fixed.get(name, theirs[name].default), name
