"""RouterConfig: built from flags (and --config FILE, tests/unit/routing/test_options.py),
validated on construction."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcore.events import Tier
from routing.config import (
    EventsVia,
    FailurePolicy,
    KvTransport,
    PdMode,
    RouterMode,
    WorkerAddress,
)
from routing.flags import gateway_config
from routing.placement.scorer import DEFAULT_TIER_WEIGHTS, LOWER_TIERS, ScoringWeights


def test_flags_map_to_fields(tiny_model_dir: Path) -> None:
    """Every flag lands in its field; repeated --worker keeps order."""
    cfg = gateway_config(
        [
            "--worker",
            "http://127.0.0.1:9001",
            "--worker",
            "http://localhost:9002/",
            "--router-mode",
            "approx",
            "--overlap-weight",
            "2",
            "--router-temperature",
            "0.5",
            "--block-size",
            "32",
            "--port",
            "0",
            "--model-path",
            str(tiny_model_dir),
            "--max-in-flight-per-worker",
            "4",
        ]
    )
    assert [w.url for w in cfg.workers] == ["http://127.0.0.1:9001", "http://localhost:9002"]
    assert cfg.router_mode is RouterMode.APPROX
    assert (cfg.overlap_weight, cfg.router_temperature, cfg.block_size) == (2.0, 0.5, 32)
    assert cfg.port == 0 and cfg.max_in_flight_per_worker == 4
    assert cfg.model_names == (tiny_model_dir.name,)
    assert cfg.prefill_load_scale is None  # not given: learned from the fleet's feedback


def test_weights_are_learned_unless_given() -> None:
    """Without --overlap-weight / --prefill-load-scale both weights are learned (None)."""
    cfg = gateway_config(["--worker", "http://127.0.0.1:9001"])
    assert (cfg.overlap_weight, cfg.prefill_load_scale) == (None, None)


def test_every_tier_has_a_credit_flag() -> None:
    """--host-weight, --disk-weight and --remote-weight set the tiers' credits (docs/tiers.md)."""
    cfg = gateway_config(["--worker", "http://127.0.0.1:9001", "--host-weight", "0.5",
                          "--disk-weight", "0.2", "--remote-weight", "0.3"])
    assert (cfg.host_weight, cfg.disk_weight, cfg.remote_weight) == (0.5, 0.2, 0.3)
    assert cfg.tier_weights == {Tier.HOST: 0.5, Tier.DISK: 0.2, Tier.REMOTE: 0.3}
    assert set(cfg.tier_weights) == set(LOWER_TIERS)  # a new tier needs its flag


def test_the_scorer_credits_a_tier_at_its_flags_default() -> None:
    """The tiers' default credits are written once, as the flags' defaults: a gateway given
    no --<tier>-weight and a scorer given no weights credit each tier alike."""
    default = gateway_config(["--worker", "http://127.0.0.1:9001"])
    assert (default.host_weight, default.disk_weight, default.remote_weight) == (0.75, 0.25, 0.1)
    assert ScoringWeights().tier_weights == default.tier_weights
    assert ScoringWeights().tier_weights is DEFAULT_TIER_WEIGHTS  # one mapping, shared


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "at least one --sidecar URL, --sidecar-file or --worker"),
        (["--worker", "https://x:1"], "argument --worker: worker URL must start with http://"),
        (["--worker", "http://x:1", "--worker", "http://x:1"], "listed twice"),
        (["--worker", "http://x:1", "--block-size", "0"],
             "argument --block-size: must be in [1, 4096], got 0"),
        (["--worker", "http://x:1", "--overlap-weight", "-1"],
             "argument --overlap-weight: must be a finite number >= 0, got -1.0"),
        (["--worker", "http://x:1", "--remote-weight", "-1"],
             "argument --remote-weight: must be a finite number >= 0, got -1.0"),
        (["--worker", "http://x:1", "--router-mode", "magic"], "invalid choice"),
        (["--worker", "http://x:1", "--model-path", "/nonexistent"], "no tokenizer.json"),
    ],
)
def test_bad_flags_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad flag is an argparse error (exit 2) naming the problem."""
    with pytest.raises(SystemExit) as info:
        gateway_config(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_worker_address_parse() -> None:
    """Worker URLs keep a base path and get a default port."""
    a = WorkerAddress.parse("http://engine/v2/")
    assert (a.host, a.port, a.base_path, a.url) == ("engine", 80, "/v2", "http://engine:80/v2")


def test_security_flags_map_to_fields(tmp_path: Path) -> None:
    """--api-key-file, the rate limits, TLS and the sidecar token land in their fields."""
    files = {name: tmp_path / name for name in ("keys", "cert", "key", "token", "secret")}
    for path in files.values():
        path.write_text("x y\n")
    cfg = gateway_config(
        ["--worker", "http://127.0.0.1:9001", "--api-key-file", str(files["keys"]),
         "--rate-limit-rps", "5", "--rate-limit-tps", "1000", "--rate-limit-burst-s", "2",
         "--tenant-salt-secret-file", str(files["secret"]), "--tls-cert", str(files["cert"]),
         "--tls-key", str(files["key"]), "--sidecar-token-file", str(files["token"])]
    )
    assert cfg.api_key_file == files["keys"]
    assert (cfg.rate_limit_rps, cfg.rate_limit_tps, cfg.rate_limit_burst_s) == (5, 1000, 2)
    assert (cfg.tls_cert, cfg.tls_key) == (files["cert"], files["key"])
    assert cfg.sidecar_token_file == files["token"]
    assert cfg.tenant_salt_secret_file == files["secret"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tls-cert", "{cert}"], "both --tls-cert and --tls-key"),
        (["--rate-limit-rps", "5"], "give --api-key-file too"),
        (["--api-key-file", "{missing}"], "--api-key-file .* is not a readable file"),
        (["--api-key-file", "{cert}", "--rate-limit-tps", "0"],
         "argument --rate-limit-tps: must be a finite number > 0"),
    ],
)
def test_security_flags_are_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    cert = tmp_path / "cert"
    cert.write_text("pem")
    argv = [a.format(cert=cert, missing=tmp_path / "nope") for a in extra]
    with pytest.raises(SystemExit):
        gateway_config(["--worker", "http://127.0.0.1:9001", *argv])
    assert re.search(message, capsys.readouterr().err)


def test_tokenizer_cache_size_is_a_flag() -> None:
    cfg = gateway_config(["--worker", "http://127.0.0.1:9001", "--tokenizer-cache-tokens", "0"])
    assert cfg.tokenizer_cache_tokens == 0
    assert gateway_config(["--worker", "http://127.0.0.1:9001"]).tokenizer_cache_tokens == 4_000_000
    with pytest.raises(SystemExit):
        gateway_config(["--worker", "http://127.0.0.1:9001", "--tokenizer-cache-tokens", "-1"])


def test_idle_connections_per_worker_is_a_flag() -> None:
    """The upstream pool's idle keep-alive connections per worker, a field without a flag
    before the options became fields."""
    cfg = gateway_config(["--worker", "http://127.0.0.1:9001",
                          "--max-idle-connections-per-worker", "0"])
    assert cfg.max_idle_connections_per_worker == 0
    with pytest.raises(SystemExit):
        gateway_config(["--worker", "http://127.0.0.1:9001",
                        "--max-idle-connections-per-worker", "-1"])


def test_string_vocabularies_are_enums(tiny_model_dir: Path) -> None:
    """--pd-mode, --kv-load-failure-policy, --kv-transport and --events-via land as members
    of the config's enums; a value outside one is refused by argparse, naming the choices."""
    cfg = gateway_config(["--sidecar", "http://127.0.0.1:9001", "--model-path",
                          str(tiny_model_dir), "--pd-mode", "sglang", "--kv-transport", "tcp",
                          "--kv-load-failure-policy", "fail", "--events-via", "nats",
                          "--nats", "nats://127.0.0.1:4222"])
    assert (cfg.pd_mode, cfg.kv_transport, cfg.kv_load_failure_policy, cfg.events_via) == (
        PdMode.SGLANG, KvTransport.TCP, FailurePolicy.FAIL, EventsVia.NATS)
    with pytest.raises(SystemExit):
        gateway_config(["--worker", "http://127.0.0.1:9001", "--kv-transport", "rdma"])
