"""Package boundaries of shm/: what importing it pulls in, and that each module stands alone."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FORBIDDEN = {"torch", "aiohttp", "sidecar", "routing", "sglang", "tensorrt_llm"}


def test_shm_loads_no_torch_or_higher_layer() -> None:
    """Importing shm loads neither torch (lazy, for tensors only) nor sidecar/routing/aiohttp."""
    code = "import sys, json, shm; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    loaded = {name.split(".")[0] for name in json.loads(out.stdout)}
    assert not loaded & FORBIDDEN


@pytest.mark.parametrize(
    "module",
    ["shm", *(info.name for info in pkgutil.walk_packages([str(ROOT / "shm")], prefix="shm."))],
)
def test_each_module_imports_on_its_own(module: str) -> None:
    """Every shm module imports in a fresh interpreter."""
    subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, check=True)
