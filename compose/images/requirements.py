"""Print one requirement list of pyproject.toml, one per line, for ``pip install -r``.

    python3 requirements.py dependencies        # the core (gateway / sidecar) dependencies
    python3 requirements.py engine-plugin       # an extra: what the engine plugins need

The Containerfiles install dependencies in a layer of their own (rebuilt only when
pyproject.toml changes), then the project itself with ``--no-deps``; the plugin test builds
the same list, so pyproject.toml is the one place the lists live. Standard library only.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, name: str) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    if name == "dependencies":
        return list(project["dependencies"])
    extras = project.get("optional-dependencies", {})
    if name not in extras:
        raise SystemExit(f"pyproject.toml has no extra {name!r} (extras: {', '.join(extras)})")
    return list(extras[name])


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: requirements.py NAME [PYPROJECT]", file=sys.stderr)
        return 2
    default = Path(__file__).resolve().parents[2] / "pyproject.toml"
    path = Path(argv[1]) if len(argv) == 2 else default
    print("\n".join(requirements(path, argv[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
