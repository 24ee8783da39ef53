"""RouterConfig: built from flags only, validated on construction."""

from __future__ import annotations

from pathlib import Path

import pytest

from routing.config import RouterConfig, RouterMode, WorkerAddress


def test_flags_map_to_fields(tiny_model_dir: Path) -> None:
    """Every flag lands in its field; repeated --worker keeps order."""
    cfg = RouterConfig.from_args(
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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "at least one --sidecar URL, --sidecar-file or --worker"),
        (["--worker", "https://x:1"], "http://"),
        (["--worker", "http://x:1", "--worker", "http://x:1"], "listed twice"),
        (["--worker", "http://x:1", "--block-size", "0"], "block_size"),
        (["--worker", "http://x:1", "--overlap-weight", "-1"], "overlap_weight"),
        (["--worker", "http://x:1", "--router-mode", "magic"], "invalid choice"),
        (["--worker", "http://x:1", "--model-path", "/nonexistent"], "no tokenizer.json"),
    ],
)
def test_bad_flags_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad flag is an argparse error (exit 2) naming the problem."""
    with pytest.raises(SystemExit) as info:
        RouterConfig.from_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_worker_address_parse() -> None:
    """Worker URLs keep a base path and get a default port."""
    a = WorkerAddress.parse("http://engine/v2/")
    assert (a.host, a.port, a.base_path, a.url) == ("engine", 80, "/v2", "http://engine:80/v2")
