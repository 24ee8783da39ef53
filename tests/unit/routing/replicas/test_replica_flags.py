"""The replica flags: --nats and its subjects, validated when the config is built."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from routing.flags import gateway_config
from routing.replicas.link import default_subject_prefix

WORKER = ["--worker", "http://127.0.0.1:9001"]
TINY = Path(__file__).resolve().parents[4] / "refengine" / "models" / "tiny"


def test_nats_flags_map_to_fields() -> None:
    """--nats, --nats-subject-prefix, --nats-peer-timeout-s and --nats-new-prompt-window-ms
    land in their fields."""
    cfg = gateway_config([*WORKER, "--nats", "nats://10.0.0.9:4222", "--nats-subject-prefix",
                          "fleet.a-1", "--nats-peer-timeout-s", "5",
                          "--nats-new-prompt-window-ms", "0"])
    assert (cfg.nats_url, cfg.nats_subject_prefix, cfg.nats_peer_timeout_s,
            cfg.nats_new_prompt_window_ms) == ("nats://10.0.0.9:4222", "fleet.a-1", 5.0, 0.0)
    assert gateway_config(WORKER).nats_url is None
    assert gateway_config(WORKER).nats_new_prompt_window_ms == 50.0


@pytest.mark.parametrize(
    "flags",
    [
        ["--nats", "http://127.0.0.1:4222"],
        ["--nats", "nats://"],
        ["--nats", "nats://h:4222", "--nats-subject-prefix", "a.*"],
        ["--nats", "nats://h:4222", "--nats-subject-prefix", "a..b"],
        ["--nats", "nats://h:4222", "--nats-peer-timeout-s", "0"],
        ["--nats", "nats://h:4222", "--nats-new-prompt-window-ms", "-1"],
        ["--nats", "nats://h:4222", "--nats-new-prompt-window-ms", "nan"],
    ],
)
def test_bad_values_are_refused(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A bad URL, subject prefix or timeout stops the gateway with a message naming it."""
    with pytest.raises(SystemExit):
        gateway_config([*WORKER, *flags])
    assert "nats" in capsys.readouterr().err


def test_events_via_flags_map_to_fields() -> None:
    """--events-via nats (with --nats) and --snapshot-interval-s land in their fields."""
    cfg = gateway_config(["--sidecar", "http://127.0.0.1:9000", "--model-path", str(TINY),
                          "--nats", "nats://h:4222", "--events-via", "nats",
                          "--snapshot-interval-s", "0"])
    assert (cfg.events_via, cfg.snapshot_interval_s) == ("nats", 0.0)
    assert gateway_config(WORKER).events_via == "direct"


@pytest.mark.parametrize(("flags", "message"), [
    (["--events-via", "nats"], "give --nats URL"),
    (["--events-via", "nats", "--nats", "nats://h:4222"], "sidecars' events"),
    (["--nats", "nats://h:4222", "--snapshot-interval-s", "-1"],
     "argument --snapshot-interval-s: must be a finite number >= 0, got -1.0"),
])
def test_bad_events_via_is_refused(flags: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--events-via nats without --nats, or a negative interval, stops the gateway."""
    with pytest.raises(SystemExit):
        gateway_config([*WORKER, *flags])
    assert message in capsys.readouterr().err


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
