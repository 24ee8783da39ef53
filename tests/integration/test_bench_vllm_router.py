"""The vllm-router benchmark runs end to end and writes the shared benchmark JSON shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.peers,  # vllm-router is a test dependency: missing, the run fails saying so
]


def test_a_short_run_writes_both_policies_and_the_ratio(tmp_path: Path) -> None:
    """A short run measures the three passes' hit rates and writes kv_aware's ratios."""
    out = tmp_path / "vllm_router.json"
    run = subprocess.run(
        [sys.executable, "scripts/bench_vllm_router.py", "--groups", "4", "--requests", "32",
         "--kv-tokens", "1536", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    assert set(data) == {"figures", "ratios"}
    for name in ("kv_aware", "round_robin", "kv_aware_without_events"):
        assert data["figures"][f"vllm_router_{name}_requests"] == 32
        assert 0 <= data["figures"][f"vllm_router_{name}_hit_rate"] <= 1
    for baseline in ("round_robin", "kv_aware_without_events"):
        assert data["ratios"][f"vllm_router_kv_aware_via_sidecar_hit_rate_vs_{baseline}"] > 0
    assert "round_robin" in run.stdout
