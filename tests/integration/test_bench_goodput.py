"""The goodput benchmark's flood load runs end to end: three tenants behind one gateway
whose queue is ordered by fair shares, then first come, first served; the fair run must
serve the quiet tenants their share, which the first-come run does not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_flood_load_gives_each_tenant_its_share_only_when_fair(tmp_path: Path) -> None:
    out = tmp_path / "goodput.json"
    run = subprocess.run(
        [sys.executable, "scripts/bench_goodput.py", "--load", "flood", "--warmup-s", "1.5",
         "--duration-s", "4", "--flood-clients", "16", "--quiet-clients", "4",
         "--prompt-words", "60", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data) == {"figures", "ratios"}
    figures = data["figures"]
    for name in ("ours", "least_loaded"):
        assert all(figures[f"{name}.{t}.tokens"] > 0 for t in ("flood", "quiet-a", "quiet-b"))
    # 16 flooding clients against 4 + 4: first come, first served gives the flood about
    # 16/24 of the tokens (Jain about 0.67); fair shares about a third each (Jain near 1).
    assert figures["least_loaded.jain_index"] < 0.8 < figures["ours.jain_index"]
    assert data["ratios"]["fairness_vs_least_loaded"] > 1.2
    assert "Jain's fairness index" in run.stdout
