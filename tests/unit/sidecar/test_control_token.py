"""The sidecar's control token: where it comes from, that it is never shown, how it is
compared."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcore.control_token import CONTROL_TOKEN_ENV, token_matches
from sidecar.config import SidecarConfig

BASE = ["--engine-url", "http://127.0.0.1:30000", "--worker-id", "r0"]


def test_the_token_comes_from_its_file_first_then_the_environment(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(" from-file \n")
    env = {CONTROL_TOKEN_ENV: "from-env"}
    assert SidecarConfig.from_args([*BASE, "--control-token-file", str(token_file)],
                                   env).control_token == "from-file"
    assert SidecarConfig.from_args(BASE, env).control_token == "from-env"
    assert SidecarConfig.from_args(BASE, {}).control_token is None


def test_the_token_is_never_in_the_configs_repr() -> None:
    cfg = SidecarConfig.from_args(BASE, {CONTROL_TOKEN_ENV: "tok-secret"})
    assert "tok-secret" not in repr(cfg)


def test_an_empty_token_file_is_refused_with_its_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("\n")
    with pytest.raises(SystemExit):
        SidecarConfig.from_args([*BASE, "--control-token-file", str(token_file)], {})
    assert "--control-token-file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "ok"),
    [("tok", True), ("tok ", False), ("to", False), ("tokk", False), ("", False), (None, False)],
)
def test_tokens_match_exactly(given: str | None, ok: bool) -> None:
    assert token_matches(given, "tok") is ok
