"""The replica flags: --nats and its subjects, validated when the config is built."""

from __future__ import annotations

import subprocess
import sys

import pytest

from routing.flags import gateway_config
from routing.replicas.link import default_subject_prefix

WORKER = ["--worker", "http://127.0.0.1:9001"]


def test_nats_flags_map_to_fields() -> None:
    """--nats, --nats-subject-prefix and --nats-peer-timeout-s land in their fields."""
    cfg = gateway_config([*WORKER, "--nats", "nats://10.0.0.9:4222", "--nats-subject-prefix",
                          "fleet.a-1", "--nats-peer-timeout-s", "5"])
    assert (cfg.nats_url, cfg.nats_subject_prefix, cfg.nats_peer_timeout_s) == (
        "nats://10.0.0.9:4222", "fleet.a-1", 5.0)
    assert gateway_config(WORKER).nats_url is None


@pytest.mark.parametrize(
    "flags",
    [
        ["--nats", "http://127.0.0.1:4222"],
        ["--nats", "nats://"],
        ["--nats", "nats://h:4222", "--nats-subject-prefix", "a.*"],
        ["--nats", "nats://h:4222", "--nats-subject-prefix", "a..b"],
        ["--nats", "nats://h:4222", "--nats-peer-timeout-s", "0"],
    ],
)
def test_bad_values_are_refused(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A bad URL, subject prefix or timeout stops the gateway with a message naming it."""
    with pytest.raises(SystemExit):
        gateway_config([*WORKER, *flags])
    assert "nats" in capsys.readouterr().err


def test_default_subject_prefix() -> None:
    """The default prefix is the model's name as a subject token, or kvsidecar."""
    assert default_subject_prefix(["Llama-3.1 8B"]) == "kvsidecar.Llama-3_1_8B"
    assert default_subject_prefix([]) == "kvsidecar"


def test_missing_extra_is_named() -> None:
    """Without nats-py, --nats stops the gateway with the extra to install."""
    code = ("import sys; sys.modules['nats'] = None; from routing.__main__ import main; "
            "sys.exit(main(['--worker', 'http://127.0.0.1:9', '--port', '0', "
            "'--nats', 'nats://127.0.0.1:9']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2, out.stderr
    assert "pip install 'kvsidecar[nats]'" in out.stderr
