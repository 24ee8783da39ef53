"""Package boundaries (docs/architecture.md): what each package may import, what the real entry
points load, and that every module stands alone."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterator
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


def _modules() -> dict[str, Path]:
    """Every module of ours, by dotted name (a package by its own name), and its file."""
    found = {}
    for package in OURS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _run_at_import(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported: not those inside a
    function, nor under ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            test = node.test
            if not (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"):
                yield from _run_at_import(node.body)
            yield from _run_at_import(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse,
                          node.finalbody):
                yield from _run_at_import(block)
        elif isinstance(node, (ast.ClassDef, ast.With, ast.For, ast.While)):
            yield from _run_at_import(node.body)


def _import_graph() -> dict[str, set[str]]:
    """Module → the modules of ours its import statements run, and read names from:
    ``import a.b`` counts ``a.b``, ``from a import b`` counts ``a``, and ``a.b`` when that is a
    module. (The packages above ``a.b`` are imported first too, but a package half imported
    while it imports its own submodules is how Python works: only reading a name from it,
    ``from a import b``, is a cycle.)"""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in _run_at_import(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                parts = package[: len(package) - node.level + 1] if node.level else []
                base = ".".join([*parts, node.module] if node.module else parts)
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            found |= {t for t in targets if t in modules and t != name}
        graph[name] = found
    return graph


def test_no_module_imports_itself_back() -> None:
    """No import-time cycle among our modules: a module never runs into one of ours that is
    still half imported, so each imports on its own as it does after any other.

    Read off the source, this replaces importing each module from a clean slate (a fresh
    interpreter per shm and transfer module, and clean-slate re-imports of five packages:
    about a hundred start-ups' worth of imports); the entry points above are imported for
    real in fresh interpreters, and ``test_every_module_imports`` imports every module.
    """
    graph = _import_graph()
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, "import cycle: " + " -> ".join((*path[path.index(name):], name))
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, (*path, name))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())
    assert sum(map(len, graph.values())) > len(graph)  # the walk saw the imports


_IMPORT_ALL = """
import importlib, json, pkgutil, sys, traceback
failed = {}
names = []
for package in sys.argv[1:]:
    names += [package, *(i.name for i in pkgutil.walk_packages([package], prefix=package + "."))]
for name in names:
    try:
        importlib.import_module(name)
    except BaseException:
        failed[name] = traceback.format_exc(limit=3)
print(json.dumps({"imported": len(names), "failed": failed}))
"""


@pytest.mark.slow  # SGLang's own import (adapters.sglang) is most of it
def test_every_module_imports() -> None:
    """Every module of ours imports (in one interpreter; with no import cycle, the order
    they come in does not matter)."""
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *OURS], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=300)
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["imported"] == len(_modules())
    assert not report["failed"], "\n".join(f"{k}:\n{v}" for k, v in report["failed"].items())
