"""The soak, short: an engine and a sidecar SIGKILLed and a gateway restarted under load,
through real processes, and no request lost (streams migrate, the gateway drains)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_a_short_soak_loses_no_request(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run(
        # shorter than --quick (24 streams, 60 s, 3 s downtimes): the faults follow each other
        # as soon as each restart is done, and the run lasts until the after phase had its
        # share, however long the restarts take here
        [sys.executable, "scripts/bench_soak.py", "--streams", "16", "--duration-s", "10",
         "--down-s", "1", "--settle-s", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| after |" in run.stdout
    data = json.loads(out.read_text())
    figures, ratios = data["figures"], data["ratios"]
    for phase in ("before", "during", "after"):
        assert figures[f"{phase}_requests"] > 0, run.stdout
    assert figures["all_lost"] == 0, run.stdout
    assert figures["all_refused"] == 0, run.stdout
    assert figures["migrations"] >= 1, run.stdout  # the killed engine's and sidecar's streams
    assert set(ratios) == {"ttft_p99_after_vs_before", "ttft_p50_after_vs_before"}
