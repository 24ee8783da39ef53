"""`kvsidecar up`'s options are UpConfig's fields: one flag per field with the field's default,
every spelling up's flags have had with the meaning they had, and --config FILE (TOML) for
every one of them, the command line winning."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvsidecar.local_stack import DEFAULT_MODEL
from kvsidecar.up import main
from kvsidecar.up_config import UpConfig, UpEngine, build_parser
from refengine.config import Compute
from routing.config import FailurePolicy, PdMode, RouterMode
from tests.support.options import as_flag_default

# Flags that are no field: argparse's own, and the file of the fields' values.
NOT_FIELDS = {"help", "config"}


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "up.toml"
    path.write_text(text)
    return str(path)


def test_every_flag_is_a_field_and_every_field_a_flag() -> None:
    """No flag of up is parsed outside UpConfig, and no field lacks a flag."""
    dests = {a.dest for a in build_parser()._actions}
    assert dests - NOT_FIELDS == {f.name for f in dataclasses.fields(UpConfig)}


def test_the_flags_defaults_are_the_fields() -> None:
    """Each flag's default is its field's (in the command line's form), and a config from no
    flags is the dataclass's defaults."""
    actions = {a.dest: a for a in build_parser()._actions}
    for f in dataclasses.fields(UpConfig):
        assert actions[f.name].default == as_flag_default(f.default), f.name
    assert UpConfig.from_args([]) == UpConfig()


def test_no_flags_mean_what_they_meant() -> None:
    """Two simulated reference engines of 32,768 tokens each behind a kv gateway on
    127.0.0.1:8000 (16,384 with --demo; no aggregated replicas beside prefill/decode ones)."""
    cfg = UpConfig()
    assert (cfg.engine, cfg.compute, cfg.agg_replicas, cfg.kv_tokens) == (
        UpEngine.REF, Compute.SIM, 2, 32768)
    assert (cfg.host, cfg.port, cfg.router_mode) == ("127.0.0.1", 8000, RouterMode.KV)
    assert (cfg.pd_mode, cfg.kv_load_failure_policy) == (PdMode.AUTO, FailurePolicy.FALLBACK)
    assert (cfg.model_path, cfg.speedup, cfg.sim_handoff_ms_per_1k_tokens) == (
        DEFAULT_MODEL, 1.0, 0.0)
    assert UpConfig(demo=True).kv_tokens == 16384
    assert UpConfig(prefill=1, decode=1).agg_replicas == 0


# Every flag up has had, given a value: the field it sets and the value it holds then.
SPELLINGS = [
    (["--replicas", "3"], "replicas", 3),
    (["--prefill", "1", "--decode", "1"], "prefill", 1),
    (["--prefill", "1", "--decode", "2"], "decode", 2),
    (["--kv-load-failure-policy", "fail"], "kv_load_failure_policy", FailurePolicy.FAIL),
    (["--sim-handoff-ms-per-1k-tokens", "2.5"], "sim_handoff_ms_per_1k_tokens", 2.5),
    (["--pd-mode", "off"], "pd_mode", PdMode.OFF),
    (["--engine", "vllm"], "engine", UpEngine.VLLM),
    (["--compute", "torch"], "compute", Compute.TORCH),
    (["--host", "0.0.0.0"], "host", "0.0.0.0"),
    (["--port", "0"], "port", 0),
    (["--router-mode", "round-robin"], "router_mode", RouterMode.ROUND_ROBIN),
    (["--model-path", "/models/m"], "model_path", Path("/models/m")),
    (["--max-total-tokens", "4096"], "max_total_tokens", 4096),
    (["--speedup", "4"], "speedup", 4.0),
    (["--demo"], "demo", True),
    (["--exit-after-demo"], "exit_after_demo", True),
    (["--gateway-arg=--seed=1", "--gateway-arg=--seed=2"], "gateway_args",
     ("--seed=1", "--seed=2")),
    (["--sidecar-arg=--log-level=debug"], "sidecar_args", ("--log-level=debug",)),
    (["--engine", "vllm", "--engine-arg=--enforce-eager"], "engine_args", ("--enforce-eager",)),
    (["--engine", "vllm", "--kv-connector-store-bytes", "64MiB"], "kv_connector_store_bytes",
     64 << 20),
    (["--workdir", "/tmp/up"], "workdir", Path("/tmp/up")),
    (["--ready-file", "/tmp/up/ready.json"], "ready_file", Path("/tmp/up/ready.json")),
]


@pytest.mark.parametrize(("argv", "name", "value"), SPELLINGS, ids=[a[0] for a, *_ in SPELLINGS])
def test_every_flag_keeps_its_spelling(argv: list[str], name: str, value: object) -> None:
    """Each flag of up, spelled as the README and scripts spell it, sets its field."""
    assert getattr(UpConfig.from_args(argv), name) == value


def test_a_config_file_sets_the_options(tmp_path: Path) -> None:
    """Keys are field names or flag names, dashes or underscores; values convert as the
    flags' do, a repeatable flag's from a list."""
    path = _toml(tmp_path, """
replicas = 3
compute = "torch"
router-mode = "least-loaded"
max_total_tokens = 4096
speedup = 2
gateway-arg = ["--seed=7"]
sidecar_args = ["--log-level=debug"]
demo = true
port = 0
""")
    cfg = UpConfig.from_args(["--config", path])
    assert (cfg.replicas, cfg.compute, cfg.router_mode) == (3, Compute.TORCH,
                                                            RouterMode.LEAST_LOADED)
    assert (cfg.kv_tokens, cfg.speedup, cfg.port, cfg.demo) == (4096, 2.0, 0, True)
    assert (cfg.gateway_args, cfg.sidecar_args) == (("--seed=7",), ("--log-level=debug",))


def test_the_command_line_wins_over_the_file(tmp_path: Path) -> None:
    """A flag given replaces the file's value, a repeatable one the file's whole list; what
    the command line leaves out comes from the file."""
    path = _toml(tmp_path, 'replicas = 3\nport = 0\ngateway-arg = ["--seed=7"]\n')
    cfg = UpConfig.from_args(["--config", path, "--replicas", "5", "--gateway-arg=--seed=8"])
    assert (cfg.replicas, cfg.port, cfg.gateway_args) == (5, 0, ("--seed=8",))


@pytest.mark.parametrize(("text", "why"), [
    ("replicas = 3\nreplica = 4\n", "unknown option 'replica' (keys are the flags' names"),
    ('compute = "gpu"\n', "compute: must be one of torch, sim, got 'gpu'"),
    ('replicas = "three"\n', "replicas: expected an int, got 'three'"),
])
def test_a_bad_key_or_value_in_the_file_is_refused(
    text: str, why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key that names no option of up, or a value its flag would refuse: exit 2 naming the
    file and the key."""
    path = _toml(tmp_path, text)
    with pytest.raises(SystemExit) as stopped:
        UpConfig.from_args(["--config", path])
    assert stopped.value.code == 2
    assert f"--config {path}: {why}" in capsys.readouterr().err


def test_the_files_passed_flags_are_checked_by_their_own_parsers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A gateway flag passed through from the file is parsed by the gateway's parser before
    anything starts, as one from the command line is."""
    path = _toml(tmp_path, 'gateway-arg = ["--no-such-flag"]\n')
    with pytest.raises(SystemExit) as stopped:
        main(["--config", path, "--workdir", "/nonexistent/never-made"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--gateway-arg: the arguments above were refused" in err and "no-such-flag" in err


@pytest.mark.parametrize(("argv", "why"), [
    (["--prefill", "1"], "--prefill N and --decode M go together, each >= 1"),
    (["--replicas", "0"], "--replicas must be >= 1 (>= 0 with --prefill/--decode)"),
    (["--decode", "-1"], "argument --decode: must be >= 0, got -1"),
])
def test_what_up_cannot_run_is_refused(argv: list[str], why: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Replica counts that make no stack: exit 2 with the reason."""
    with pytest.raises(SystemExit) as stopped:
        UpConfig.from_args(argv)
    assert stopped.value.code == 2
    assert why in capsys.readouterr().err


def test_code_gives_the_vocabularies_plain_strings() -> None:
    """A config built in code may name a member by its value, and is held to the relations
    the flags are."""
    cfg = UpConfig(compute="torch", router_mode="random")  # type: ignore[arg-type]
    assert (cfg.compute, cfg.router_mode) == (Compute.TORCH, RouterMode.RANDOM)
    with pytest.raises(ValueError, match="--compute must be torch or sim, got 'gpu'"):
        UpConfig(compute="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="goes with --engine vllm"):
        UpConfig(engine_args=("--enforce-eager",))
