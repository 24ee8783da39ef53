"""``kvsidecar webhook``'s options are WebhookConfig's fields (the sidecar's, inject's own):
one flag per field, the flags' old spellings and defaults, --config FILE, and
KVSIDECAR_SIDECAR_IMAGE."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvcore.logs import LogLevel
from kvsidecar.inject import build_parser as inject_parser
from kvsidecar.inject_options import InjectOptions
from kvsidecar.webhook_config import WebhookConfig, build_parser

NOT_FIELDS = {"help", "config"}  # argparse's own, and the file of the fields' values
TLS = ["--tls-cert", "/tls/tls.crt", "--tls-key", "/tls/tls.key"]
IMAGE_ENV = "KVSIDECAR_SIDECAR_IMAGE"


@pytest.fixture(autouse=True)
def _no_image_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests set the image's variable themselves, or not at all."""
    monkeypatch.delenv(IMAGE_ENV, raising=False)


def test_every_flag_is_a_field_and_every_field_a_flag() -> None:
    dests = {a.dest for a in build_parser()._actions} - NOT_FIELDS
    assert dests == {f.name for f in dataclasses.fields(WebhookConfig)}


def test_inject_has_a_flag_per_option_too() -> None:
    """``kvsidecar inject``: its file's flags and one per InjectOptions field."""
    dests = {a.dest for a in inject_parser()._actions} - NOT_FIELDS - {"filename", "output"}
    assert dests == {f.name for f in dataclasses.fields(InjectOptions)}


def test_the_flags_keep_their_spellings_and_defaults() -> None:
    """The flags argparse declared by hand before still parse, to the same defaults."""
    cfg = WebhookConfig.from_args(TLS)
    assert (cfg.host, cfg.port, cfg.tls_cert, cfg.tls_key) == (
        "0.0.0.0", 8443, Path("/tls/tls.crt"), Path("/tls/tls.key"))
    assert (cfg.label_key, cfg.label_value, cfg.log_level, cfg.ready_file) == (
        "kvsidecar.io/inject", "enabled", LogLevel.INFO, None)
    assert cfg.inject == InjectOptions()
    cfg = WebhookConfig.from_args([
        *TLS, "--host", "127.0.0.1", "--port", "0", "--label", "team=kv", "--log-level", "debug",
        "--ready-file", "/tmp/ready", "--sidecar-image", "r/kvsidecar:1", "--sidecar-port",
        "9100", "--store-capacity-bytes", "4GiB", "--sidecar-arg=--model-id",
        "--sidecar-arg=llama"])
    assert (cfg.host, cfg.port, cfg.label_key, cfg.label_value) == ("127.0.0.1", 0, "team", "kv")
    assert (cfg.log_level, cfg.ready_file) == (LogLevel.DEBUG, Path("/tmp/ready"))
    assert cfg.inject == InjectOptions(sidecar_image="r/kvsidecar:1", sidecar_port=9100,
                                       store_capacity_bytes="4GiB",
                                       sidecar_args=("--model-id", "llama"))


def test_a_config_file_gives_the_options(tmp_path: Path) -> None:
    """--config FILE takes the flags' names; a flag on the command line wins."""
    path = tmp_path / "webhook.toml"
    path.write_text('tls-cert = "/c.pem"\ntls_key = "/k.pem"\nport = 9443\n'
                    'sidecar-arg = ["--model-id", "llama"]\nlabel = "a=b"\n')
    cfg = WebhookConfig.from_args(["--config", str(path), "--port", "9444"])
    assert (cfg.tls_cert, cfg.tls_key, cfg.port, cfg.label) == (
        Path("/c.pem"), Path("/k.pem"), 9444, "a=b")
    assert cfg.sidecar_args == ("--model-id", "llama")


def test_the_sidecar_image_may_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the Kubernetes manifest sets it: KVSIDECAR_SIDECAR_IMAGE, under --sidecar-image."""
    monkeypatch.setenv(IMAGE_ENV, "ghcr.io/kvsidecar/kvsidecar-gateway:1")
    assert WebhookConfig.from_args(TLS).sidecar_image == "ghcr.io/kvsidecar/kvsidecar-gateway:1"
    assert WebhookConfig.from_args([*TLS, "--sidecar-image", "x"]).sidecar_image == "x"
    help_text = {a.dest: a.help for a in build_parser()._actions}["sidecar_image"]
    assert help_text is not None and help_text.endswith(f"(env {IMAGE_ENV})")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--label", "enabled"], "--label must be KEY=VALUE, got 'enabled'"),
        (["--label", "=x"], "--label needs a key"),
        (["--port", "70000"], "argument --port: must be in [0, 65535], got 70000"),
        (["--sidecar-port", "0"], "argument --sidecar-port: must be in [1, 65535], got 0"),
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
        (["--store-capacity-bytes", "lots"], "'lots' is not a byte size"),
    ],
)
def test_bad_values_are_argparse_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad flag exits 2 naming the problem."""
    with pytest.raises(SystemExit) as info:
        WebhookConfig.from_args([*TLS, *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
