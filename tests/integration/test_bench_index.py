"""The index benchmark runs end to end and writes the shared benchmark JSON shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_run_writes_figures_and_ratios(tmp_path: Path) -> None:
    """--quick --json writes {figures, ratios}; every ratio is named <figure>_vs_<peer>."""
    out = tmp_path / "index.json"
    run = subprocess.run(
        [sys.executable, "scripts/bench_index.py", "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert "match_1024_p50_us" in run.stdout
    data = json.loads(out.read_text())
    assert set(data) == {"figures", "ratios"}
    figures = data["figures"]
    assert figures["pinned.orphan_blocks_after_stream"] == 0
    assert figures["pinned.mixed_events_per_s"] > 0
    try:
        import dynamo.llm  # noqa: F401
    except ImportError:
        return
    assert "pinned.match_1024_p50_us_vs_dynamo" in data["ratios"]
    assert all(name.split(".", 1)[1].endswith("_vs_dynamo") for name in data["ratios"])
