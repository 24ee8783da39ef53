"""Package boundaries of shm/: what importing it pulls in (that each module stands alone is
checked with every other package's, in tests/test_structure.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FORBIDDEN = {"torch", "aiohttp", "sidecar", "routing", "sglang", "tensorrt_llm"}


def test_shm_loads_no_torch_or_higher_layer() -> None:
    """Importing shm loads neither torch (lazy, for tensors only) nor sidecar/routing/aiohttp."""
    code = "import sys, json, shm; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    loaded = {name.split(".")[0] for name in json.loads(out.stdout)}
    assert not loaded & FORBIDDEN

