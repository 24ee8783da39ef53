"""The gateway's options are RouterConfig's fields: one flag per field, the same defaults, and
--config FILE (TOML) for the gateway and the endpoint picker."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from routing.config import FailurePolicy, PdMode, RouterConfig, RouterMode, WorkerAddress
from routing.epp.config import EppConfig
from routing.flags import gateway_config, gateway_parser
from routing.placement.scorer import LOWER_TIERS, ScoringWeights
from tests.support.options import as_flag_default

WORKER = "http://127.0.0.1:9001"
# Flags that are no field: argparse's own, and the file of the fields' values.
NOT_FIELDS = {"help", "config"}


def test_every_flag_is_a_field_and_every_field_a_flag() -> None:
    dests = {a.dest for a in gateway_parser()._actions}
    assert dests - NOT_FIELDS == {f.name for f in dataclasses.fields(RouterConfig)}


def test_the_flags_defaults_are_the_fields() -> None:
    """Each flag's default is its field's (in the command line's form), and a config from no
    flags but a worker is the dataclass's defaults."""
    actions = {a.dest: a for a in gateway_parser()._actions}
    for f in dataclasses.fields(RouterConfig):
        assert actions[f.name].default == as_flag_default(f.default), f.name
    worker = WorkerAddress.parse(WORKER)
    assert gateway_config(["--worker", WORKER]) == RouterConfig(workers=(worker,))


def test_the_flags_keep_their_spellings() -> None:
    """Fields whose flag is not their name with dashes."""
    flags = {a.dest: a.option_strings[0] for a in gateway_parser()._actions}
    assert {k: flags[k] for k in ("workers", "sidecars", "served_model_names", "k8s_insecure",
                                  "nats_url")} == {
        "workers": "--worker", "sidecars": "--sidecar",
        "served_model_names": "--served-model-name",
        "k8s_insecure": "--k8s-insecure-skip-tls-verify", "nats_url": "--nats"}


def test_every_scoring_weight_has_a_flag() -> None:
    """ScoringWeights' fields are all set from the gateway's flags (the temperature is
    --router-temperature; each tier's weight below the GPU, --<tier>-weight)."""
    fields = {f.name for f in dataclasses.fields(RouterConfig)}
    for f in dataclasses.fields(ScoringWeights):
        if not f.init:
            continue  # derived from the others
        if f.name == "tier_weights":
            for tier in LOWER_TIERS:
                assert f"{tier.name.lower()}_weight" in fields, tier
            continue
        name = "router_temperature" if f.name == "temperature" else f.name
        assert name in fields, f.name


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    return str(path)


def test_a_config_file_sets_the_options(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Keys are flag names or field names, dashes or underscores; values convert as the
    flags' do."""
    path = _toml(tmp_path, f"""
worker = ["{WORKER}", "http://127.0.0.1:9002"]
model-path = "{tiny_model_dir}"
served_model_name = ["a", "b"]
router-mode = "approx"
overlap_weight = 2
block-size = 32
session-affinity = true
pd-mode = "off"
kv_load_failure_policy = "fail"
nats-url = "nats://10.0.0.9:4222"
snapshot-interval-s = 5
port = 0
log_level = "debug"
""")
    cfg = gateway_config(["--config", path])
    assert [w.url for w in cfg.workers] == [WORKER, "http://127.0.0.1:9002"]
    assert cfg.model_path == tiny_model_dir and cfg.served_model_names == ("a", "b")
    assert (cfg.router_mode, cfg.overlap_weight, cfg.block_size) == (RouterMode.APPROX, 2.0, 32)
    assert cfg.session_affinity and cfg.port == 0
    assert (cfg.pd_mode, cfg.kv_load_failure_policy) == (PdMode.OFF, FailurePolicy.FAIL)
    assert (cfg.nats_url, cfg.snapshot_interval_s) == ("nats://10.0.0.9:4222", 5.0)
    path = _toml(tmp_path, f'workers = ["{WORKER}"]\nnats = "nats://h:4222"\n')
    assert gateway_config(["--config", path]).nats_url == "nats://h:4222"


def test_flags_override_the_file(tmp_path: Path) -> None:
    """A flag given beats the file's value; a repeated flag replaces the file's list."""
    path = _toml(tmp_path, f'worker = ["{WORKER}"]\nblock_size = 32\nport = 1\n')
    cfg = gateway_config(["--config", path, "--block-size", "64",
                          "--worker", "http://127.0.0.1:9005"])
    assert (cfg.block_size, cfg.port) == (64, 1)
    assert [w.url for w in cfg.workers] == ["http://127.0.0.1:9005"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nats_server = \"nats://h:1\"\n", "unknown option 'nats_server'"),
        ("grpc_port = 1\n", "unknown option 'grpc_port'"),
        ("block_size = \"big\"\n", "block_size: expected an int, got 'big'"),
        ("router-mode = \"magic\"\n", "router-mode: must be one of kv, approx"),
        ("sidecar = [\"https://x:1\"]\n", "sidecar: worker URL must start with http://"),
        ("block_size = 0\n", "block_size: must be in [1, 4096], got 0"),
    ],
)
def test_a_bad_config_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    """An unknown key (never dropped) or a bad value: exit 2, naming the key."""
    path = _toml(tmp_path, f'worker = ["{WORKER}"]\n{text}')
    with pytest.raises(SystemExit) as info:
        gateway_config(["--config", path])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_endpoint_picker_reads_its_options_from_the_file_too(tmp_path: Path) -> None:
    path = _toml(tmp_path, f'worker = ["{WORKER}"]\ngrpc-port = 0\nbody_mode = "buffered"\n')
    cfg = EppConfig.from_args(["--config", path])
    assert (cfg.grpc_port, cfg.body_mode.value, cfg.router.port) == (0, "buffered", 9090)
    assert EppConfig.from_args(["--config", path, "--grpc-port", "7"]).grpc_port == 7


def test_a_gateway_only_option_in_the_pickers_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _toml(tmp_path, f'worker = ["{WORKER}"]\npd-mode = "off"\n')
    with pytest.raises(SystemExit):
        EppConfig.from_args(["--config", path])
    assert "--pd-mode does not apply to the endpoint picker" in capsys.readouterr().err


def test_up_and_replay_use_the_configs_vocabularies() -> None:
    """``kvsidecar up`` passes --router-mode, --pd-mode and --kv-load-failure-policy on to the
    gateway, and replay compares the gateway's router modes: the config's enums, not copies."""
    from kvsidecar.up_config import build_parser as up_parser
    from replay.config import POLICY_CHOICES

    assert set(POLICY_CHOICES) == {m.value for m in RouterMode} | {"oracle", "all"}
    choices = {a.dest: a.choices for a in up_parser()._actions}
    assert choices["router_mode"] == [m.value for m in RouterMode]
    assert choices["pd_mode"] == [m.value for m in PdMode]
    assert choices["kv_load_failure_policy"] == [p.value for p in FailurePolicy]


def test_the_variables_are_those_the_manifests_set() -> None:
    """Only the options deploy/k8s hands the gateway through its environment read one, and a
    variable's value is the flag's (tests/unit/deploy/test_k8s_manifests.py checks the
    manifests name no other)."""
    from kvcore.option_specs import option_specs

    read = {s.meta.env: s.name for s in option_specs(RouterConfig) if s.meta.env}
    assert read == {"KVSIDECAR_MODEL_PATH": "model_path", "KVSIDECAR_ROUTER_MODE": "router_mode",
                    "KVSIDECAR_BLOCK_SIZE": "block_size", "KVSIDECAR_LOG_LEVEL": "log_level",
                    "KVSIDECAR_DISCOVER_K8S_SELECTOR": "discover_k8s_selector"}
    env = {"KVSIDECAR_ROUTER_MODE": "round-robin", "KVSIDECAR_BLOCK_SIZE": "32"}
    cfg = gateway_config(["--worker", WORKER, "--block-size", "64"], gateway_parser(env))
    assert (cfg.router_mode, cfg.block_size) == (RouterMode.ROUND_ROBIN, 64)
