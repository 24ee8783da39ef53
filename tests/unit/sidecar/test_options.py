"""The sidecar's options are SidecarConfig's fields: one flag per field (the two secrets
aside, which come from files or the environment), the same defaults, and --config FILE."""

from __future__ import annotations

import argparse
import dataclasses
import socket
from pathlib import Path

import pytest

from adapters.base import EngineKind, LoraAdapter
from kvcore.jetstream import EventsVia
from kvcore.layout import LayoutKind
from sidecar.config import HandoffKind, SidecarConfig
from sidecar.zmq_publisher import ZmqPublishConfig
from tests.support.options import as_flag_default, config_toml, refusal

URL = "http://127.0.0.1:30000"
SECRETS = {"engine_api_key", "control_token"}  # derived: never flags
NESTED = {"zmq_publish": ZmqPublishConfig}  # fields whose options are another config's
# Every flag given once, each value away from its default; the config the flags make.
EVERY = ["--engine", "trtllm", "--engine-url", URL + "/", "--model-id", "m",
         "--model-path", "/models/m", "--block-size", "32", "--kv-events-endpoint",
         "tcp://127.0.0.1:5557", "--kv-events-replay-endpoint", "tcp://127.0.0.1:5558",
         "--kv-events-ranks", "2", "--lora-adapter", "ad=1:/ckpt/ad",
         "--control-token-file", "TOKEN",
         "--engine-api-key-file", "KEY", "--worker-id", "w1", "--role", "decode",
         "--host", "0.0.0.0", "--port", "9000", "--replay-buffer-events", "10",
         "--subscriber-queue-frames", "20", "--load-report-interval-s", "1.5",
         "--silent-after-s", "5", "--upstream-timeout-s", "60", "--shutdown-timeout-s", "2",
         "--log-level", "debug", "--ready-file", "/tmp/ready", "--store-capacity-bytes", "1GiB",
         "--store-socket", "/tmp/s.sock", "--store-block-bytes", "64KiB", "--store-layout",
         "page_first", "--disk-tier-dir", "/var/kv", "--disk-tier-capacity-bytes", "4GiB",
         "--remote-tier-url", "redis://cache:6379/0", "--remote-tier-write", "evict",
         "--transfer-tcp-port", "7000", "--advertise-host", "10.0.0.5", "--kv-handoff",
         "transfer", "--disaggregation-bootstrap-port", "8998",
         "--sim-handoff-ms-per-1k-tokens", "3", "--events-via", "nats", "--nats",
         "nats://h:4222", "--events-max-age-s", "60", "--events-max-bytes", "2GiB",
         "--publish-zmq", "tcp://*:5600", "--publish-zmq-replay", "tcp://*:5601",
         "--publish-zmq-topic", "kv", "--publish-zmq-hash", "xxhash_cbor",
         "--publish-zmq-hash-seed", "7", "--publish-zmq-buffer-steps", "50"]
# --load-endpoint is SGLang's alone: checked apart.
NOT_IN_EVERY = {"--load-endpoint"}


def _full(tmp_path: Path) -> SidecarConfig:
    return SidecarConfig(
        engine=EngineKind.TRTLLM, engine_url=URL, model_id="m", model_path="/models/m",
        block_size=32, kv_events_endpoint="tcp://127.0.0.1:5557",
        kv_events_replay_endpoint="tcp://127.0.0.1:5558", kv_events_ranks=2,
        lora_adapters=(LoraAdapter.parse("ad=1:/ckpt/ad"),),
        control_token_file=str(tmp_path / "token"), engine_api_key_file=str(tmp_path / "key"),
        worker_id="w1", role="decode", host="0.0.0.0", port=9000, replay_buffer_events=10,
        subscriber_queue_frames=20, load_report_interval_s=1.5, silent_after_s=5.0,
        upstream_timeout_s=60.0, shutdown_timeout_s=2.0, log_level="debug",
        ready_file="/tmp/ready", store_capacity_bytes=1 << 30, store_socket="/tmp/s.sock",
        store_block_bytes=64 << 10, store_layout=LayoutKind.PAGE_FIRST,
        disk_tier_dir="/var/kv", disk_tier_capacity_bytes=4 << 30,
        remote_tier_url="redis://cache:6379/0", remote_tier_write="evict",
        transfer_tcp_port=7000, advertise_host="10.0.0.5", kv_handoff=HandoffKind.TRANSFER,
        disaggregation_bootstrap_port=8998, sim_handoff_ms_per_1k_tokens=3.0,
        events_via=EventsVia.NATS, nats_url="nats://h:4222", events_max_age_s=60.0,
        events_max_bytes=2 << 30, engine_api_key="sk-1", control_token="tok-1",
        zmq_publish=ZmqPublishConfig(endpoint="tcp://*:5600", replay_endpoint="tcp://*:5601",
                                     topic="kv", hash_algo="xxhash_cbor", hash_seed="7",
                                     buffer_steps=50))


def _every(tmp_path: Path) -> list[str]:
    (tmp_path / "key").write_text("sk-1\n")
    (tmp_path / "token").write_text("tok-1\n")
    files = {"KEY": str(tmp_path / "key"), "TOKEN": str(tmp_path / "token")}
    return [files.get(arg, arg) for arg in EVERY]


def _option_actions() -> list[argparse.Action]:
    return [a for a in SidecarConfig.parser()._actions if a.dest not in ("help", "config")]


def test_every_flag_is_a_field_and_every_field_a_flag_but_the_secrets() -> None:
    actions = _option_actions()
    fields = {f.name for f in dataclasses.fields(SidecarConfig)} - SECRETS - set(NESTED)
    fields |= {f.name for nested in NESTED.values() for f in dataclasses.fields(nested)}
    assert {a.dest for a in actions} == fields
    flags = {a.option_strings[0] for a in actions}
    assert flags - NOT_IN_EVERY == {arg for arg in EVERY if arg.startswith("--")}


def test_the_flags_defaults_are_the_fields() -> None:
    """Each flag's default is its field's; a config of the engine URL alone is the
    dataclass's defaults, its worker id derived from the URL."""
    actions = {a.dest: a for a in _option_actions()}
    for f in (*dataclasses.fields(SidecarConfig), *dataclasses.fields(ZmqPublishConfig)):
        if f.name not in SECRETS and f.name not in NESTED:
            assert actions[f.name].default == as_flag_default(f.default), f.name
            assert actions[f.name].required == (f.name == "engine_url"), f.name
    cfg = SidecarConfig.from_args(["--engine-url", URL], {})
    assert cfg == SidecarConfig(engine_url=URL)
    assert cfg.worker_id == f"{socket.gethostname()}-30000"


def test_every_flag_sets_its_field(tmp_path: Path) -> None:
    assert SidecarConfig.from_args(_every(tmp_path), {}) == _full(tmp_path)


def test_the_flags_keep_their_spellings() -> None:
    """Fields whose flag is not their name with dashes."""
    flags = {a.dest: a.option_strings[0] for a in _option_actions()}
    assert (flags["lora_adapters"], flags["nats_url"]) == ("--lora-adapter", "--nats")


def test_a_config_file_round_trips(tmp_path: Path) -> None:
    """Every option written to a TOML file by field name reads back as the same config (the
    engine URL, required, included; the secrets read from the files it names); a flag on the
    command line still wins."""
    full = _full(tmp_path)
    _every(tmp_path)  # the key and token files
    values = {k: v for k, v in dataclasses.asdict(full).items()
              if k not in SECRETS and k not in NESTED}
    values.update(dataclasses.asdict(full.zmq_publish))
    values["lora_adapters"] = ("ad=1:/ckpt/ad",)
    path = tmp_path / "sidecar.toml"
    path.write_text(config_toml(values))
    assert SidecarConfig.from_args(["--config", str(path)], {}) == full
    again = SidecarConfig.from_args(["--config", str(path), "--role", "prefill"], {})
    assert again == dataclasses.replace(full, role="prefill")


def test_a_config_file_takes_flag_names_and_sizes(tmp_path: Path) -> None:
    """Keys are flag names (dashes) or field names; sizes as strings or numbers; a repeated
    flag replaces the file's list."""
    path = tmp_path / "sidecar.toml"
    path.write_text(f'engine-url = "{URL}"\nworker_id = "r0"\nstore-capacity-bytes = "1GiB"\n'
                    'events_max_bytes = 2147483648\nnats = "nats://h:4222"\n'
                    'events-via = "nats"\nlora-adapter = ["a=1", "b=2"]\n')
    cfg = SidecarConfig.from_args(["--config", str(path)], {})
    assert (cfg.engine_url, cfg.worker_id, cfg.store_capacity_bytes) == (URL, "r0", 1 << 30)
    assert (cfg.events_max_bytes, cfg.nats_url, cfg.events_via) == (
        2 << 30, "nats://h:4222", EventsVia.NATS)
    assert [a.name for a in cfg.lora_adapters] == ["a", "b"]
    cfg = SidecarConfig.from_args(["--config", str(path), "--lora-adapter", "c=3"], {})
    assert [a.name for a in cfg.lora_adapters] == ["c"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('worker = "r0"\n', "unknown option 'worker'"),
        ('engine = "tgi"\n', "engine: must be one of sglang, trtllm, vllm, got 'tgi'"),
        ('role = "both"\n', "role: must be one of agg, prefill, decode, got 'both'"),
        ("port = \"high\"\n", "port: expected an int, got 'high'"),
        ('store-capacity-bytes = "lots"\n', "store-capacity-bytes: 'lots' is not a byte size"),
        ('disk-tier-dir = "/var/kv"\n', "--disk-tier-dir keeps blocks evicted"),
    ],
)
def test_a_bad_config_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    """An unknown key (never dropped) or a bad value: exit 2, naming the key or the flag."""
    path = tmp_path / "sidecar.toml"
    path.write_text(f'engine_url = "{URL}"\n{text}')
    assert message in refusal(lambda: SidecarConfig.from_args(["--config", str(path)], {}), capsys)


def test_the_engine_url_is_required_from_the_flags_or_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        SidecarConfig.from_args([], {})
    assert "the following arguments are required: --engine-url" in capsys.readouterr().err
    path = tmp_path / "sidecar.toml"
    path.write_text('role = "prefill"\n')
    with pytest.raises(SystemExit):
        SidecarConfig.from_args(["--config", str(path)], {})
    assert "required: --engine-url" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine", "tgi"], "argument --engine: invalid choice: 'tgi'"),
        (["--role", "both"], "argument --role: invalid choice: 'both'"),
        (["--port", "70000"], "argument --port: must be in [0, 65535], got 70000"),
        (["--kv-handoff", "transfer"], "--kv-handoff transfer pulls blocks"),
        (["--store-capacity-bytes", "2TB"], "argument --store-capacity-bytes: '2TB' is not a"),
        (["--silent-after-s", "0"],
         "argument --silent-after-s: must be a finite number > 0, got 0.0"),
        (["--events-via", "nats", "--nats", "nats://h:4222,http://h:4223"],
         "--nats must be nats://HOST:PORT (or tls://, comma-separated for a cluster)"),
    ],
)
def test_bad_flags_exit_2(argv: list[str], message: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--engine-url", URL, *argv]
    assert message in refusal(lambda: SidecarConfig.from_args(argv, {}), capsys)


def test_code_may_give_a_vocabularys_plain_string() -> None:
    """A config built in code with "vllm" or "transfer" holds the members; another string is
    refused naming the flag and its values."""
    cfg = SidecarConfig(engine_url=URL, engine="vllm",  # type: ignore[arg-type]
                        kv_handoff="transfer", store_capacity_bytes=1 << 20)  # type: ignore[arg-type]
    assert (cfg.engine, cfg.kv_handoff) == (EngineKind.VLLM, HandoffKind.TRANSFER)
    with pytest.raises(ValueError, match="--engine must be sglang, trtllm or vllm, got 'tgi'"):
        SidecarConfig(engine_url=URL, engine="tgi")  # type: ignore[arg-type]


def _choices(parser: argparse.ArgumentParser) -> dict[str, list[object] | None]:
    """Each flag's choices, by its spelling."""
    found: dict[str, list[object] | None] = {}
    for a in parser._actions:
        for flag in a.option_strings:
            found[flag] = None if a.choices is None else list(a.choices)
    return found


def test_names_and_values_agree_across_commands() -> None:
    """A flag that two commands share is spelled alike and takes the same values: the engine
    kinds of the sidecar and of inject, the roles inject announces, the gateway's and the
    sidecar's --events-via, every --log-level, the tier flags of the sidecar and shm, and the
    engine's and the router's options that offline replay simulates."""
    from kvsidecar.engine_role import ROLES
    from kvsidecar.inject import build_parser as inject_parser
    from kvsidecar.webhook import build_parser as webhook_parser
    from refengine.config import build_parser as engine_parser
    from replay.config import build_parser as replay_parser
    from routing.flags import gateway_parser
    from shm.owner.config import owner_parser
    from sidecar.transfer.peer_config import BlockPeerConfig

    sidecar = _choices(SidecarConfig.parser())
    gateway, shm = _choices(gateway_parser()), _choices(owner_parser())
    engine = _choices(engine_parser())
    assert engine["--log-level"] == sidecar["--log-level"]
    defaults = {p.prog: {a.option_strings[0]: a.default for a in p._actions if a.option_strings}
                for p in (engine_parser(), replay_parser(), gateway_parser())}
    engine_d, replay_d = defaults["kvsidecar engine"], defaults["kvsidecar replay"]
    for flag in ("--sim-prefill-base-ms", "--sim-prefill-us-per-token", "--sim-decode-base-ms",
                 "--sim-decode-us-per-seq", "--page-size", "--chunked-prefill-size",
                 "--max-running-requests"):
        assert engine_d[flag] == replay_d[flag], flag
    for flag in ("--router-temperature", "--approx-ttl-s"):  # replay's router is the gateway's
        assert defaults["kvsidecar gateway"][flag] == replay_d[flag], flag
    engines = [e.value for e in EngineKind]
    assert sidecar["--engine"] == _choices(inject_parser())["--engine"] == engines
    assert sidecar["--role"] == list(ROLES)
    assert sidecar["--events-via"] == gateway["--events-via"] == [v.value for v in EventsVia]
    assert sidecar["--log-level"] == gateway["--log-level"] == shm["--log-level"]
    for parser in (BlockPeerConfig.parser(), webhook_parser()):  # LogLevel's, as the gateway's
        assert _choices(parser)["--log-level"] == gateway["--log-level"], parser.prog
    for flag in ("--disk-tier-dir", "--disk-tier-capacity-bytes", "--remote-tier-url",
                 "--remote-tier-write"):
        assert sidecar[flag] == shm[flag], flag
