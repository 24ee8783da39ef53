"""The fleet-scale index benchmark runs end to end, small, and writes the shared benchmark
JSON shape; every block the fleet holds is indexed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_a_small_fleet_run_writes_figures_and_ratios(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    run = subprocess.run(
        [sys.executable, "scripts/bench_fleet.py", "--workers", "16", "--blocks", "50000",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "match_1024_p99_us" in run.stdout
    data = json.loads(out.read_text())
    figures, ratios = data["figures"], data["ratios"]
    assert figures["indexed_blocks"] == 50000 and figures["workers"] == 16
    for name in ("blocks_per_s", "match_128_p99_us", "match_1024_p99_us",
                 "rss_bytes_per_block", "rss_total_mib"):
        assert figures[name] > 0 and figures[f"dynamo_{name}"] > 0
        assert ratios[f"{name}_vs_dynamo"] > 0
