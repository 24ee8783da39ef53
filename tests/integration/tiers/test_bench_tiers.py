"""The tier benchmark runs end to end (engines, stores, disk and remote tiers) and writes the shared
benchmark JSON shape; every tier it reports was verified as hit by the run itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.slow


def test_quick_run_reports_every_tier(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    run = subprocess.run(
        # a quarter of --quick's 1,024-token prompt: 16 pages still go through every tier
        [sys.executable, "scripts/bench_tiers.py", "--prompt-tokens", "256", "--runs", "1",
         "--model-preset", "tiny", "--dir", str(tmp_path), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "remote hit" in run.stdout
    data = json.loads(out.read_text())
    assert set(data) == {"figures", "ratios"}
    figures, ratios = data["figures"], data["ratios"]
    for tier in ("gpu", "host", "disk", "remote"):
        assert figures[f"{tier}_hit_ttft_s"] > 0
        assert ratios[f"{tier}_hit_ttft_vs_recompute"] > 0
    assert figures["recompute_ttft_s"] > 0
    assert figures["disk_seq_read_gbps"] > 0 and figures["memcpy_gbps"] > 0
    assert figures["redis_benchmark_get_gbps"] > 0
    assert not list(tmp_path.glob("bench-tiers-*"))  # the disk tier's directory is removed
