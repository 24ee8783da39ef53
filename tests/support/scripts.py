"""Load a script of ``scripts/`` as a module, with the imports it has when run.

``python scripts/bench_x.py`` puts ``scripts/`` first on ``sys.path``, so a script imports
``benchkit`` and its sibling scripts by name; loading one from its path alone would not.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py``, executed as the module ``name`` (in ``sys.modules``, as if
    imported); ``sys.path`` as it was afterwards, whatever the script's imports added."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"no script {name} in {SCRIPTS}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: dataclasses look their module up there
    saved = sys.path[:]
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module
