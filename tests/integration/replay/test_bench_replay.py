"""The replay benchmark runs end to end and writes the shared benchmark JSON shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_quick_run_writes_figures_and_ratios(tmp_path: Path) -> None:
    """--quick --json writes {figures, ratios} with the issue's three target ratios."""
    out = tmp_path / "replay.json"
    run = subprocess.run(
        [sys.executable, "scripts/bench_replay.py", "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "| kv |" in run.stdout and "bound: pooled-belady" in run.stdout
    data = json.loads(out.read_text())
    assert set(data) == {"figures", "ratios"}
    ratios = data["ratios"]
    for name in (
        "kv_hit_rate_vs_round_robin",
        "kv_hit_rate_vs_oracle",
        "kv_ttft_p99_vs_least_loaded",
    ):
        assert ratios[name] > 0
    assert all("_vs_" in name for name in ratios)
    assert data["figures"]["oracle_hit_rate"] >= data["figures"]["pooled_lru_hit_rate"]
