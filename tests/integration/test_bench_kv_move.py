"""The kv-move benchmark runs end to end and writes the shared benchmark JSON shape, every
mode measured and every ratio against a baseline of the same run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_a_small_run_measures_the_move_against_herding_and_recompute(tmp_path: Path) -> None:
    """One wave of each mode, a short prompt: figures for the three modes, both ratios."""
    out = tmp_path / "kv-move.json"
    run = subprocess.run(
        [sys.executable, "scripts/bench_kv_move.py", "--waves", "1", "--warmup-waves", "0",
         "--burst", "3", "--system-tokens", "256", "--output-tokens", "4", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data) == {"figures", "ratios"}
    for mode in ("herd", "recompute", "move"):
        assert data["figures"][f"{mode}.ttft_p50_s"] > 0, run.stdout
    for baseline in ("herding", "recompute"):
        assert f"ttft_p50_s_vs_{baseline}" in data["ratios"], run.stdout
