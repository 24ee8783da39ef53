"""The transfer benchmark runs end to end over every transport and writes the shared
benchmark JSON shape: a script no other test starts broke once without anyone noticing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("transports", ["shm,tcp", "shm,nixl,tcp"])
def test_a_small_run_measures_every_path_against_its_baseline(
    tmp_path: Path, transports: str
) -> None:
    """Without NIXL the baselines' blocks are held through a TCP export (the shm path has
    none over HTTP: it once failed right there); with it, through a NIXL one."""
    out = tmp_path / "transfer.json"
    run = subprocess.run(
        [sys.executable, "scripts/bench_transfer.py", "--block-mib", "1", "--batch", "4",
         "--rounds", "2", "--warmup", "1", "--transports", transports, "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data) == {"figures", "ratios"}
    pairs = {"shm": "memcpy", "nixl": "raw_nixl", "tcp": "raw_socket"}
    paths = transports.split(",")
    for path in paths:
        for name in (path, pairs[path]):
            assert data["figures"][f"{name}_gbps"] > 0, run.stdout
            assert f"| {name} |" in run.stdout
    assert set(data["ratios"]) == {f"{p}_gbps_vs_{pairs[p]}" for p in paths}
