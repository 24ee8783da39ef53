"""The step-price probe (scripts/probe_step_price.py) reads a running sim engine: a row per
token of one stream and a row per stream count on a shared prefix, each with the mocker's
polynomial beside it when the pool is given (what the numbers are, the goodput diary says:
no timed asserts here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvsidecar.local_stack import EngineSpec, LocalStack, StackSpec

ROOT = Path(__file__).resolve().parents[2]
POOL = 64 * 16

pytestmark = pytest.mark.slow


def _rows(text: str, header: str) -> list[list[str]]:
    """The rows of the table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def test_the_probe_tabulates_each_token_and_each_stream_count(tmp_path: Path) -> None:
    spec = StackSpec(
        engines=(EngineSpec(sidecars=False, args=(
            "--served-model-name", "tiny", "--page-size", "16", "--sim-model", "mocker",
            "--enable-mixed-chunk", "--max-running-requests", "4")),),
        gateways=(), max_total_tokens=POOL, speedup=20.0, log_level="warning")
    with LocalStack(spec, tmp_path) as stack:
        url = stack.engines[0].url
        run = subprocess.run(
            [sys.executable, "scripts/probe_step_price.py", url, "--prompt", "40",
             "--max-tokens", "12", "--repeats", "2", "--shared", "32", "--own", "4",
             "--streams", "1", "3", "--pool-tokens", str(POOL)],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    tokens = _rows(run.stdout, "token  context")
    assert [int(r[0]) for r in tokens] == list(range(2, 12))
    assert all(len(r) == 5 and all(float(v) > 0 for v in r[2:]) for r in tokens), tokens
    streams = _rows(run.stdout, "streams  shared")
    assert [int(r[0]) for r in streams] == [1, 3]
    assert all(len(r) == 6 and all(float(v) > 0 for v in r[3:]) for r in streams), streams


def test_a_probe_too_short_to_read_mid_stream_is_refused() -> None:
    run = subprocess.run([sys.executable, "scripts/probe_step_price.py", "http://127.0.0.1:9",
                          "--max-tokens", "4"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and "--max-tokens must be at least 8" in run.stderr
