"""Package boundaries (docs/architecture.md): what each package may import, what the real entry
points load, and that every module stands alone."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
OURS = ("kvcore", "shm", "adapters", "sidecar", "routing", "refengine", "replay", "kvsidecar")
HEAVY = {"torch", "sglang", "tensorrt_llm", "nixl", "nixl_cu12", "posix_ipc", "matplotlib"}


def _import_table() -> dict[str, set[str]]:
    """Package → the packages of ours it may import, read off the architecture document."""
    table: dict[str, set[str]] = {}
    text = ARCHITECTURE.read_text()
    section = text.split("## Packages and what each may import", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        package = cells[0].strip("`")
        may = cells[2]
        if may.startswith("every package"):
            table[package] = set(OURS)
        elif may == "nothing of ours":
            table[package] = set()
        else:
            table[package] = set(re.findall(r"`(\w+)`", may))
    return table


def _imports_of(path: Path) -> set[str]:
    """Top-level packages of ours a module imports anywhere (lazily, or for type checking)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(n.split(".")[0] for n in names if n.split(".")[0] in OURS)
    return found


def test_the_table_names_every_package() -> None:
    """The architecture document's import table lists exactly our packages."""
    assert set(_import_table()) == set(OURS)


@pytest.mark.parametrize("package", OURS)
def test_imports_follow_the_table(package: str) -> None:
    """No module imports a package of ours that the table does not allow its package."""
    allowed = _import_table()[package] | {package}
    wrong = {
        str(path.relative_to(ROOT)): sorted(extra)
        for path in sorted((ROOT / package).rglob("*.py"))
        if (extra := _imports_of(path) - allowed)
    }
    assert not wrong, f"{package} may import only {sorted(allowed)}: {wrong}"


def _loaded_after_import(module: str) -> set[str]:
    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return {name.split(".")[0] for name in json.loads(out.stdout)}


@pytest.mark.parametrize(
    ("entry", "forbidden"),
    [
        ("routing.__main__", HEAVY | {"shm", "adapters", "sidecar", "refengine", "replay"}),
        ("sidecar.__main__", HEAVY - {"posix_ipc"} | {"routing", "refengine", "replay"}),
        ("kvcore.wire", HEAVY | set(OURS) - {"kvcore"}),
        ("kvsidecar.__main__", HEAVY | set(OURS) - {"kvcore", "kvsidecar"}),
        ("refengine.launcher", HEAVY | set(OURS) - {"kvcore", "refengine"}),
    ],
)
def test_entry_points_load_only_their_own(entry: str, forbidden: set[str]) -> None:
    """The gateway's and the sidecar's real entry points load no engine, no torch and no
    package of ours above their own; the CLI loads only the subcommand it runs; the reference
    engine loads torch only to compute with it (``--compute torch``, or a host tier), not to
    simulate."""
    loaded = _loaded_after_import(entry)
    assert not loaded & forbidden, sorted(loaded & forbidden)


# Imports every module of a package in one interpreter, each from a clean slate: before each,
# every module of ours is dropped from sys.modules, so a module that imports only because
# another was loaded first (an order-dependent or circular import) fails as it would alone.
# Third-party modules stay loaded: they never import ours. One interpreter per package, not
# one per module: 4 start-ups instead of 130.
_IMPORT_EACH = f"""
import importlib, json, pkgutil, sys, traceback
ours = {OURS!r}
package = sys.argv[1]
names = [package, *(i.name for i in pkgutil.walk_packages([package], prefix=package + "."))]
failed = {{}}
for name in names:
    for loaded in [m for m in sys.modules if m.split(".")[0] in ours]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException:
        failed[name] = traceback.format_exc(limit=3)
print(json.dumps({{"imported": len(names), "failed": failed}}))
"""


@pytest.mark.parametrize("package", ["kvcore", "adapters", "routing", "kvsidecar"])
def test_each_module_imports_on_its_own(package: str) -> None:
    """Every module of the package imports with no other module of ours loaded (no circular
    or order-dependent imports)."""
    out = subprocess.run([sys.executable, "-c", _IMPORT_EACH, package], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["imported"] > 1
    assert not report["failed"], "\n".join(f"{k}:\n{v}" for k, v in report["failed"].items())
