"""Waiting for ``.venv-vllm/`` when ``scripts/test`` builds it alongside the suite.

``scripts/test`` runs ``scripts/_vllm_venv.sh`` in the background (its pip is bound by the
network and by unpacking, so ruff, mypy and pytest run meanwhile) and exports
``KVS_VLLM_VENV_LOG``: the installer's output goes there, and its exit status to
``<log>.exit`` once it ends. The tests that start vLLM wait for that file, bounded; an
installer that failed fails them with the log's tail. Without the variable (the venv built
beforehand, or by hand) there is nothing to wait for.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.polling import wait_until

__all__ = ["LOG_ENV", "wait_for_vllm_venv"]

LOG_ENV = "KVS_VLLM_VENV_LOG"
_TAIL_LINES = 40


def wait_for_vllm_venv(timeout_s: float) -> None:
    """Return once a background build of ``.venv-vllm/`` has succeeded (at once if none runs);
    ``AssertionError`` naming the log if it failed or is still running after ``timeout_s``."""
    log = os.environ.get(LOG_ENV)
    if not log:
        return
    exit_file = Path(f"{log}.exit")

    def ended() -> str:
        assert exit_file.exists(), f"{exit_file} not written yet (the installer runs; log: {log})"
        return exit_file.read_text().strip()

    status = wait_until(ended, f"the background build of .venv-vllm/ (log: {log})",
                        timeout_s, interval_s=1.0)
    if status != "0":
        lines = Path(log).read_text(errors="replace").splitlines()[-_TAIL_LINES:]
        raise AssertionError(
            f"building .venv-vllm/ failed (exit {status}); the installer's log is {log}, "
            "ending:\n" + "\n".join(lines)
        )
