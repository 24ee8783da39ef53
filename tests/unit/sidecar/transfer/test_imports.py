"""Transfer modules stand alone, and NIXL stays an optional, lazily imported extra."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
MODULES = ["sidecar.transfer", "shm.local", "shm.reader", "shm.readonly"] + [
    info.name for info in pkgutil.walk_packages([str(ROOT / "sidecar" / "transfer")],
                                                prefix="sidecar.transfer.")
]


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_on_its_own(module: str) -> None:
    """Each module imports in a fresh interpreter."""
    subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, check=True)


def test_importing_the_service_does_not_load_nixl() -> None:
    """NIXL is imported on first use of the nixl transport, not with the package."""
    code = ("import sys, json, sidecar.transfer; "
            "print(json.dumps([m for m in sys.modules if m.startswith('nixl')]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout) == []
