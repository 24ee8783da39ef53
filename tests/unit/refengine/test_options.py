"""The reference engine's options are EngineConfig's fields: one flag per field, the same
defaults, --config FILE, and what the flags describe (events, timing, page store) derived."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from refengine.config import Compute, DisaggMode, EngineConfig, build_parser
from refengine.timing import SimModel, SimTiming, TimingModel
from refengine.tokenizer import DEFAULT_MODEL_PATH
from tests.support.options import as_flag_default, config_toml, refusal

EVENTS = '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","topic":"kv-events"}'
EXTRA = '{"file_path":"/tmp/pages"}'
# Every flag given once, each value away from its default; the config the flags make.
EVERY = ["--host", "0.0.0.0", "--port", "0", "--replicas", "2", "--ready-file", "/tmp/ready",
         "--log-level", "debug", "--api-key", "sk-1", "--model-path", str(DEFAULT_MODEL_PATH),
         "--model-preset", "kv-heavy", "--served-model-name", "m", "--compute", "sim",
         "--torch-threads", "2", "--random-seed", "7", "--page-size", "32",
         "--max-total-tokens", "4096", "--chunked-prefill-size", "256",
         "--max-running-requests", "8", "--enable-mixed-chunk",
         "--share-in-flight-prefill", "--kv-events-config", EVENTS,
         "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
         "--hicache-storage-backend-extra-config", EXTRA, "--hicache-host-pages", "64",
         "--hicache-write-policy", "write_through", "--disaggregation-mode", "prefill",
         "--speedup", "10", "--sim-model", "mocker", "--sim-prefill-base-ms", "1",
         "--sim-prefill-us-per-token", "20",
         "--sim-decode-base-ms", "4", "--sim-decode-us-per-seq", "100"]
FULL = EngineConfig(
    host="0.0.0.0", port=0, replicas=2, ready_file=Path("/tmp/ready"), log_level="debug",
    api_key="sk-1", model_preset="kv-heavy", served_model_name="m", compute=Compute.SIM,
    torch_threads=2, random_seed=7, page_size=32, max_total_tokens=4096,
    chunked_prefill_size=256, max_running_requests=8, enable_mixed_chunk=True,
    share_in_flight_prefill=True, kv_events_config=EVENTS,
    enable_hierarchical_cache=True, hicache_storage_backend="file",
    hicache_storage_backend_extra_config=EXTRA, hicache_host_pages=64,
    disaggregation_mode=DisaggMode.PREFILL, speedup=10.0, sim_model=SimModel.MOCKER,
    sim=SimTiming(sim_prefill_base_ms=1.0, sim_prefill_us_per_token=20.0,
                  sim_decode_base_ms=4.0, sim_decode_us_per_seq=100.0))
# The options: EngineConfig's fields but sim, whose own fields are the --sim-* flags.
OPTIONS = [f for cls in (EngineConfig, SimTiming) for f in dataclasses.fields(cls)
           if f.name != "sim"]


def _option_actions() -> list[argparse.Action]:
    return [a for a in build_parser()._actions if a.dest not in ("help", "config")]


def test_every_flag_is_a_field_and_every_field_a_flag() -> None:
    actions = _option_actions()
    assert {a.dest for a in actions} == {f.name for f in OPTIONS}
    assert {a.option_strings[0] for a in actions} == {a for a in EVERY if a.startswith("--")}


def test_the_flags_defaults_are_the_fields() -> None:
    """Each flag's default is its field's; no flags make the dataclass's defaults, whose
    simulated timing is TimingModel's own."""
    actions = {a.dest: a for a in _option_actions()}
    for f in OPTIONS:
        assert actions[f.name].default == as_flag_default(f.default), f.name
    cfg = EngineConfig.from_args([])
    assert cfg == EngineConfig()
    assert cfg.timing == TimingModel() and not cfg.kv_events.enabled and cfg.page_store is None


def test_every_flag_sets_its_field_and_the_derived_values() -> None:
    cfg = EngineConfig.from_args(EVERY)
    assert cfg == FULL
    assert cfg.kv_events.enabled and cfg.kv_events.topic == "kv-events"
    assert cfg.hicache_extra_config == json.loads(EXTRA) and cfg.page_store == "file"
    assert (cfg.timing.prefill_base_s, cfg.timing.decode_per_seq_s, cfg.timing.speedup) == (
        0.001, 0.0001, 10.0)
    assert cfg.timing.shape is SimModel.MOCKER
    assert "sk-1" not in repr(cfg)


def test_hierarchical_cache_alone_is_the_memory_store() -> None:
    assert EngineConfig.from_args(["--enable-hierarchical-cache"]).page_store == "memory"


def test_a_config_file_round_trips(tmp_path: Path) -> None:
    """Every field written to TOML by name reads back as the same config; a flag wins."""
    path = tmp_path / "engine.toml"
    values = {**dataclasses.asdict(FULL), **dataclasses.asdict(FULL.sim)}
    del values["sim"]
    path.write_text(config_toml(values))
    assert EngineConfig.from_args(["--config", str(path)]) == FULL
    again = EngineConfig.from_args(["--config", str(path), "--page-size", "64"])
    assert again == dataclasses.replace(FULL, page_size=64)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--compute", "gpu"], "argument --compute: invalid choice: 'gpu'"),
        (["--port", "70000"], "argument --port: must be in [0, 65535], got 70000"),
        (["--replicas", "2"], "--replicas > 1 needs --compute sim"),
        (["--kv-events-config", "{"], "--kv-events-config is not valid JSON"),
        (["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", "[1"],
         "--hicache-storage-backend-extra-config is not valid JSON"),
        (["--disaggregation-mode", "decode"], "moves pages through the page store"),
        (["--speedup", "0"], "argument --speedup: must be a finite number > 0, got 0.0"),
    ],
)
def test_bad_flags_exit_2(argv: list[str], message: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    assert message in refusal(lambda: EngineConfig.from_args(argv), capsys)


@pytest.mark.parametrize(
    ("text", "message"),
    [('pages = 3\n', "unknown option 'pages'"),
     ('compute = "gpu"\n', "compute: must be one of torch, sim, got 'gpu'"),
     ('page-size = "big"\n', "page-size: expected an int, got 'big'"),
     ('hicache-storage-backend = "s3"\n', "must be one of memory, file, dynamic")],
)
def test_a_bad_config_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(text)
    assert message in refusal(lambda: EngineConfig.from_args(["--config", str(path)]), capsys)
