"""The warm-start benchmark runs end to end and writes the shared benchmark JSON shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_small_run_writes_figures_and_ratios(tmp_path: Path) -> None:
    """A small run checks its gateways' indexes equal and writes {figures, ratios}."""
    out = tmp_path / "warm.json"
    run = subprocess.run(
        [sys.executable, "scripts/bench_warm_start.py", "--blocks", "20000", "--workers", "4",
         "--repeats", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "warm_start_s" in run.stdout
    data = json.loads(out.read_text())
    assert set(data) == {"figures", "ratios"}
    assert set(data["ratios"]) == {"warm_start_s_vs_target", "warm_start_vs_full_replay"}
    assert data["figures"]["indexed_blocks"] > 19000  # held until the last eviction
