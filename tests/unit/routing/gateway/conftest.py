"""Fixtures of the gateway unit tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(f"_gateway_{name}", module)
    spec.loader.exec_module(module)
    return module


tiny_model = _load("tiny_model")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-3-style model directory with a small trained BPE tokenizer."""
    return tiny_model.write_model_dir(tmp_path_factory.mktemp("tiny-model"))
