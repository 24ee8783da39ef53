"""Package boundaries (DESIGN.md): what each package may pull in, and that modules stand alone."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN_IN_GATEWAY = ["torch", "posix_ipc", "shm", "sglang", "tensorrt_llm", "nixl", "refengine"]


def _loaded_after_import(module: str) -> set[str]:
    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return {name.split(".")[0] for name in json.loads(out.stdout)}


def test_gateway_core_imports_no_torch_or_engine() -> None:
    """Importing routing loads no torch, posix_ipc, shm, engine package or nixl."""
    loaded = _loaded_after_import("routing")
    assert not loaded & set(FORBIDDEN_IN_GATEWAY)


def test_canonical_model_is_light() -> None:
    """The canonical model (shared by everyone) loads neither torch nor any engine."""
    loaded = _loaded_after_import("kvcore.wire")
    assert not loaded & set(FORBIDDEN_IN_GATEWAY)


def _our_modules() -> list[str]:
    names = []
    for package in ("kvcore", "adapters", "routing", "kvsidecar"):
        path = ROOT / package
        names.append(package)
        names.extend(
            info.name for info in pkgutil.walk_packages([str(path)], prefix=f"{package}.")
        )
    return names


@pytest.mark.parametrize("module", _our_modules())
def test_each_module_imports_on_its_own(module: str) -> None:
    """Every module imports in a fresh interpreter (no circular or order-dependent imports)."""
    subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, check=True)
