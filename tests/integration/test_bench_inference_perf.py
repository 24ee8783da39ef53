"""The inference-perf harness's own parts, without inference-perf (Python >= 3.12 and a heavy
environment of its own, run by hand): the config it writes asks for the shared-prefix load
at a capacity where placement matters, its tokenizer resolves offline to our model
directory, the Python that builds its environment is checked, and its report is read."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from tokenizers import Tokenizer

from tests.support.scripts import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_inference_perf")


def test_the_config_asks_for_a_shared_prefix_load_that_outgrows_one_replica(
        bench: ModuleType, tmp_path: Path) -> None:
    args = bench.parser().parse_args([])
    path = tmp_path / "config.yaml"
    written = bench.write_config(path, args, "http://127.0.0.1:1234", tmp_path / "reports")
    config = yaml.safe_load(path.read_text())
    assert config == written
    assert config["api"] == {"type": "completion", "streaming": True}
    assert config["server"]["base_url"] == "http://127.0.0.1:1234"
    assert config["server"]["model_name"] == bench.MODEL.name
    assert config["load"]["type"] == "constant"
    assert config["load"]["stages"] == [{"rate": args.rate, "duration": args.duration}]
    assert config["storage"]["local_storage"]["path"] == str(tmp_path / "reports")
    assert config["data"]["type"] == "shared_prefix"
    shared = config["data"]["shared_prefix"]
    assert shared["num_groups"] == args.groups and shared["seed"] == args.seed
    assert not shared["enable_multi_turn_chat"]
    prefixes = shared["num_groups"] * shared["system_prompt_len"]
    # one replica cannot hold every group, but its share of them under kv placement
    assert prefixes > args.max_total_tokens
    assert prefixes / args.replicas + shared["question_len"] < args.max_total_tokens
    model = json.loads((bench.MODEL / "config.json").read_text())
    prompt = shared["system_prompt_len"] + shared["question_len"] + shared["output_len"]
    assert prompt <= model["max_position_embeddings"]


def test_the_tokenizer_resolves_offline_to_the_model_directory(bench: ModuleType,
                                                               tmp_path: Path) -> None:
    config = bench.write_config(tmp_path / "c.yaml", bench.parser().parse_args([]),
                                "http://x", tmp_path)
    # a local directory: AutoTokenizer.from_pretrained reads it without the hub
    local = Path(config["tokenizer"]["pretrained_model_name_or_path"])
    assert local.is_absolute() and local == bench.MODEL
    settings = json.loads((local / "tokenizer_config.json").read_text())
    assert settings["tokenizer_class"] == "PreTrainedTokenizerFast"
    tokenizer = Tokenizer.from_file(str(local / "tokenizer.json"))
    assert tokenizer.get_vocab_size() > 256 and tokenizer.encode("a shared prefix").ids


def test_the_python_that_builds_its_environment_is_checked(bench: ModuleType,
                                                           tmp_path: Path) -> None:
    def fake(version: str) -> str:
        python = tmp_path / f"python-{version.replace(' ', '.')}"
        python.write_text(f"#!/bin/sh\necho {version}\n")
        python.chmod(0o755)
        return str(python)

    assert bench.find_python(fake("3 12")) == fake("3 12")
    assert bench.find_python(fake("3 13")) == fake("3 13")
    for refused in (fake("3 11"), str(tmp_path / "absent")):
        with pytest.raises(SystemExit, match="--python"):
            bench.find_python(refused)
    assert bench.python_version(sys.executable) == sys.version_info[:2]


def test_the_figures_come_from_its_summary_report(bench: ModuleType) -> None:
    summary = {
        "successes": {
            "count": 1200,
            "latency": {"time_to_first_token": {"mean": 0.065, "p99": 0.175}},
            "throughput": {"requests_per_sec": 19.9, "output_tokens_per_sec": 636.8},
            "prompt_tokens": {"total": 2_476_800.0, "cached": 2_352_000.0},
        },
        "failures": {"count": 0},
    }
    figures = bench.lifecycle_figures(summary)
    assert figures == pytest.approx({
        "ttft_mean_ms": 65.0, "ttft_p99_ms": 175.0, "request_throughput_rps": 19.9,
        "output_tokens_per_s": 636.8, "requests": 1200, "failures": 0,
        "client_hit_rate": 2_352_000 / 2_476_800})
    del summary["successes"]["throughput"]  # type: ignore[attr-defined]
    with pytest.raises(SystemExit, match=r"successes\.throughput\.requests_per_sec"):
        bench.lifecycle_figures(summary)
