"""``kvsidecar up``: the local stack on the embedded CPU default.

The gateway, sidecar and reference engine are being built (see the README's status table);
until they exist this command says so and runs what does: the routing core's benchmark on a
realistic multi-worker event stream.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_COMPONENTS = {
    "routing core (canonical hashing, prefix index, scorer)": "routing.prefix_index",
    "shared-memory block store": "shm.store",
    "reference engine": "refengine.server",
    "sidecar": "sidecar.app",
    "gateway": "routing.app",
}


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvsidecar up",
        description="Start the local stack (gateway + reference engines + sidecars) on loopback. "
        "Until every component exists, it reports what is missing and runs what exists.",
    )
    parser.parse_args(argv)
    missing = []
    for name, module in _COMPONENTS.items():
        ok = _present(module)
        print(f"  [{'x' if ok else ' '}] {name}")
        if not ok:
            missing.append(name)
    if missing:
        print(f"\nnot built yet: {', '.join(missing)}; running the routing core benchmark.\n")
        bench = _ROOT / "scripts" / "bench_index.py"
        return subprocess.call([sys.executable, str(bench), "--quick"])
    print("every component is present, but the stack launcher is not wired yet.")
    return 1
