"""`kvsidecar up --gateway-arg / --sidecar-arg`: any gateway or sidecar flag through up, after
up's own (a later flag wins), checked by the gateway's and sidecar's own parsers before any
process starts; `--engine vllm`'s gateway block size, its KV connector's wiring and what
it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsidecar.local_stack import DEFAULT_MODEL
from kvsidecar.local_vllm import VllmServer
from kvsidecar.up import check_passed_args, gateway_argv, main, sidecar_argv, stack_spec
from kvsidecar.up_config import UpConfig
from routing.config import RouterMode
from routing.flags import gateway_config
from sidecar.config import SidecarConfig


def test_gateway_args_come_after_ups_own_and_win() -> None:
    args = UpConfig.from_args(["--gateway-arg=--overlap-weight=7",
                               "--gateway-arg=--router-mode=random"])
    cfg = gateway_config(gateway_argv(0, RouterMode.KV, args, ["http://127.0.0.1:9000"]))
    assert cfg.overlap_weight == 7.0
    assert cfg.router_mode is RouterMode.RANDOM  # over up's own --router-mode kv
    assert check_passed_args(args) is None


def test_sidecar_args_reach_every_sidecar() -> None:
    args = UpConfig.from_args(["--sidecar-arg=--log-level=debug"])
    cfg = SidecarConfig.from_args(
        sidecar_argv("http://127.0.0.1:30000", "replica-1", "agg", 0.0, list(args.sidecar_args)))
    assert cfg.log_level == "debug" and cfg.worker_id == "replica-1"


@pytest.mark.parametrize(("flag", "value"), [("--gateway-arg", "--no-such-flag"),
                                             ("--sidecar-arg", "--no-such-flag"),
                                             ("--gateway-arg", "--overlap-weight=lots")])
def test_refused_before_anything_starts(flag: str, value: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main([f"{flag}={value}", "--workdir", "/nonexistent/never-made"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag}: the arguments above were refused" in err
    assert "no-such-flag" in err or "lots" in err  # the gateway's or sidecar's own words


def test_vllm_engines_hash_in_blocks_of_32() -> None:
    """With --engine vllm the gateway hashes as vLLM's CPU engine pages (32 tokens)."""
    args = UpConfig.from_args(["--engine", "vllm"])
    cfg = gateway_config(gateway_argv(0, RouterMode.KV, args, ["http://127.0.0.1:9000"]))
    assert cfg.block_size == 32


@pytest.mark.parametrize(("argv", "why"), [
    (["--engine-arg=--enforce-eager"], "--engine-arg goes with --engine vllm"),
    (["--kv-connector-store-bytes", "64MiB"], "--kv-connector-store-bytes goes with --engine"),
    (["--engine", "vllm", "--prefill", "1", "--decode", "1"], "aggregated replicas only"),
    (["--engine", "vllm", "--demo"], "aggregated replicas only"),
])
def test_vllm_combinations_refused(argv: list[str], why: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """What up cannot do with vLLM is refused before anything starts."""
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--workdir", "/nonexistent/never-made"])
    assert stopped.value.code == 2
    assert why in capsys.readouterr().err


def test_the_vllm_kv_connector_is_wired_to_its_sidecars_store(tmp_path: Path) -> None:
    """--kv-connector-store-bytes: vLLM loads our connector over the socket its sidecar's
    store serves, a store of that size whose blocks the sidecar sizes from the model."""
    args = UpConfig.from_args(["--engine", "vllm", "--kv-connector-store-bytes", "2MiB",
                               "--replicas", "1", "--model-path", str(DEFAULT_MODEL),
                               "--max-total-tokens", "2048"])
    options = stack_spec(args).engines[0].vllm
    assert options is not None and options.kv_connector_store_bytes == 2 << 20
    server = VllmServer.__new__(VllmServer)  # vLLM need not be here: its command line is read
    server.python, server.workdir, server.options, server.name = "python", tmp_path, options, "v"
    server.store_socket = tmp_path / "v-store.sock"
    argv = server.argv(8000)
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector_module_path"] == "adapters.vllm.connector"
    assert config["kv_load_failure_policy"] == "recompute"
    assert config["kv_connector_extra_config"] == {"socket": str(server.store_socket),
                                                   "model_id": "tiny"}
    cfg = SidecarConfig.from_args(sidecar_argv("http://127.0.0.1:9", "replica-0", "agg", 0.0,
                                               server.store_args()))
    assert cfg.store_socket == str(server.store_socket)
    assert cfg.store_capacity_bytes == 2 << 20
    assert cfg.model_path == str(DEFAULT_MODEL) and cfg.store_block_bytes is None
    assert check_passed_args(args) is None
