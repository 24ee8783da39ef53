"""The vLLM tests need ``.venv-vllm/``, which ``scripts/test`` may still be building in the
background when they come up (tests/support/vllm_venv.py)."""

from __future__ import annotations

import pytest

from tests.support.vllm_venv import wait_for_vllm_venv

# The build takes ~2 minutes on a fresh clone and starts before ruff, mypy and pytest, which
# reaches this directory ~8 minutes in; the bound leaves the module's 600 s timeout room to
# start its stack.
_VENV_WAIT_S = 240.0


@pytest.fixture(scope="module", autouse=True)
def vllm_venv_built() -> None:
    wait_for_vllm_venv(_VENV_WAIT_S)
