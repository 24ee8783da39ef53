"""The command lines ``kvsidecar.stack_argv`` gives our processes, read back by each
process's own parser: a lone gateway left at the gateway's own defaults, a stack's gateway
set as its spec says, and the lone reference engine, endpoint picker and store owner on
loopback and any port, the caller's flags winning."""

from __future__ import annotations

from pathlib import Path

from kvsidecar.stack_argv import (
    epp_argv,
    gateway_argv,
    lone_refengine_argv,
    refengine_argv,
    store_owner_argv,
)
from kvsidecar.stack_spec import DEFAULT_MODEL, EngineSpec, GatewaySpec, StackSpec
from refengine.config import EngineConfig
from routing.epp.config import EppConfig
from routing.flags import gateway_config
from shm.owner.config import OwnerConfig

WORKER = "http://127.0.0.1:9000"


def test_a_lone_gateway_has_the_gateways_own_defaults() -> None:
    """No model, no interval: only loopback, any port and the caller's flags differ from
    what ``python -m routing`` would run with."""
    spec = GatewaySpec(health_check_interval_s=None, args=("--router-mode", "random"))
    argv = gateway_argv(spec, None, [], more=["--worker", WORKER])
    plain = ["--host", "127.0.0.1", "--port", "0", "--worker", WORKER, "--router-mode", "random"]
    assert gateway_config(argv) == gateway_config(plain)
    assert gateway_config(argv).model_path is None


def test_a_stack_gateway_is_set_as_its_spec_says() -> None:
    spec = GatewaySpec(health_check_interval_s=0.2, args=("--overlap-weight", "3"))
    cfg = gateway_config(gateway_argv(spec, str(DEFAULT_MODEL), ["http://127.0.0.1:9001"]))
    assert cfg.health_check_interval_s == 0.2 and cfg.overlap_weight == 3.0
    assert cfg.model_path == DEFAULT_MODEL
    assert [s.url for s in cfg.sidecars] == ["http://127.0.0.1:9001"]


def test_the_lone_engine_publishes_nothing_and_a_stacks_starts_from_it(tmp_path: Path) -> None:
    module, *flags = lone_refengine_argv("--compute", "sim", "--port", "31000")
    assert module == "refengine"
    alone = EngineConfig.from_args(flags)
    assert alone.port == 31000 and alone.compute.value == "sim"  # the caller's flag wins
    assert not alone.kv_events.enabled
    stacked = refengine_argv(StackSpec(), EngineSpec(), tmp_path, None, [])
    assert stacked[:3] == lone_refengine_argv()
    engine = EngineConfig.from_args(stacked[1:])
    assert engine.port == 0 and engine.kv_events.enabled


def test_the_endpoint_picker_binds_loopback_on_any_ports() -> None:
    module, *flags = epp_argv("--worker", WORKER)
    assert module == "routing.epp"
    cfg = EppConfig.from_args(flags)
    assert (cfg.router.host, cfg.router.port, cfg.grpc_host, cfg.grpc_port) == (
        "127.0.0.1", 0, "127.0.0.1", 0)


def test_a_store_owner_alone_or_as_a_peer(tmp_path: Path) -> None:
    socket = tmp_path / "o1.sock"
    module, *flags = store_owner_argv("o1", socket, capacity_bytes=1 << 20, block_bytes=4096,
                                      extra=["--log-level", "debug"])
    assert module == "shm"
    cfg = OwnerConfig.from_args(flags)
    assert (cfg.owner_id, cfg.socket_path, cfg.capacity_bytes, cfg.block_bytes) == (
        "o1", socket, 1 << 20, 4096)
    assert cfg.log_level == "debug"  # the caller's flag wins
    peer = store_owner_argv("o1", socket, capacity_bytes=1 << 20, block_bytes=4096, peer=True)
    assert peer[0] == "sidecar.transfer" and peer[-2:] == ["--port", "0"]
