"""NIXL stays an optional, lazily imported extra (that each transfer module stands alone is
checked with every other module of ours, in tests/test_structure.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]


def test_importing_the_service_does_not_load_nixl() -> None:
    """NIXL is imported on first use of the nixl transport, not with the package."""
    code = ("import sys, json, sidecar.transfer; "
            "print(json.dumps([m for m in sys.modules if m.startswith('nixl')]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout) == []
