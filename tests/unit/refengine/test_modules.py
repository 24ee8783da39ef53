"""The package's CLI entry points answer --help, and the timing model's shape (that every
refengine module imports on its own is checked in tests/test_structure.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_cli_help_and_kvsidecar_entry() -> None:
    """`python -m refengine --help` and `kvsidecar engine --help` print the engine's flags."""
    for cmd in (["-m", "refengine", "--help"], ["-m", "kvsidecar", "engine", "--help"]):
        out = subprocess.run(
            [sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
        ).stdout
        for flag in (
            "--model-path",
            "--page-size",
            "--max-total-tokens",
            "--kv-events-config",
            "--compute",
            "--replicas",
            "--disaggregation-mode",
        ):
            assert flag in out


def test_timing_model_shapes() -> None:
    """Prefill grows with uncached tokens and context, decode with batch and context.

    --speedup divides every duration.
    """
    from refengine.timing import TimingModel

    t = TimingModel()
    assert t.prefill([(512, 512)]) > t.prefill([(16, 512)])
    assert t.prefill([(512, 4096)]) > t.prefill([(512, 512)])
    assert t.decode([100] * 8) > t.decode([100])
    assert t.decode([4000]) > t.decode([100])
    assert TimingModel(speedup=4).decode([100]) == pytest.approx(t.decode([100]) / 4)
    with pytest.raises(ValueError):
        TimingModel(speedup=0)
