"""The index benchmark runs end to end and writes the shared benchmark JSON shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """One small run of the benchmark, pinned pass only: its stdout and its JSON (half the
    sessions of ``--quick``: a test checks the run and its report, not the figures)."""
    out = tmp_path_factory.mktemp("bench-index") / "index.json"
    run = subprocess.run(
        [sys.executable, "scripts/bench_index.py", "--sessions", "150", "--modes", "pinned",
         "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout, json.loads(out.read_text())


def test_quick_run_writes_figures_and_ratios(quick_run: tuple[str, dict[str, Any]]) -> None:
    """--json writes {figures, ratios} with our own figures, peer or no peer."""
    stdout, data = quick_run
    assert "match_1024_p50_us" in stdout
    assert set(data) == {"figures", "ratios"}
    figures = data["figures"]
    assert figures["pinned.orphan_blocks_after_stream"] == 0
    assert figures["pinned.mixed_events_per_s"] > 0


@pytest.fixture(scope="module")
def dynamo_llm() -> None:
    """Skip (before the benchmark runs) where the peer package is not installed."""
    pytest.importorskip("dynamo.llm", reason="the peer package ai-dynamo-runtime is not installed")


@pytest.mark.peers
def test_ratios_against_dynamo(dynamo_llm: None, quick_run: tuple[str, dict[str, Any]]) -> None:
    """With ai-dynamo-runtime installed, every ratio is named <figure>_vs_dynamo."""
    _, data = quick_run
    assert "pinned.match_1024_p50_us_vs_dynamo" in data["ratios"]
    assert all(name.split(".", 1)[1].endswith("_vs_dynamo") for name in data["ratios"])
