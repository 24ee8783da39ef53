"""A test-only shim for importing SGLang's memory pools on a CPU machine.

SGLang's pool modules import its model configs, two of which import ``torchvision`` (a vision
preprocessing module and the DeepSeek-OCR config). No torchvision builds beside our CPU torch,
so those two modules, and only those, are replaced by stubs before SGLang is imported: a name
taken from them is a placeholder class that refuses to be instantiated. Nothing the pools use
comes from them.
"""

from __future__ import annotations

import sys
import types
from typing import Any

__all__ = ["VISION_MODULES", "stub_vision_modules"]

VISION_MODULES = ("sglang.srt.multimodal.internvl_utils", "sglang.srt.configs.deepseek_ocr")


def _refuse(self: object, *args: Any, **kwargs: Any) -> None:
    raise RuntimeError(f"{type(self).__name__} needs torchvision, stubbed in this test")


class _NeedsTorchvision(type):
    """A stubbed name: any class attribute reads as a string naming what is missing."""

    def __getattr__(cls, attr: str) -> str:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return f"{cls.__module__}.{cls.__name__}.{attr} (needs torchvision)"


class _VisionStub(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _NeedsTorchvision(name, (), {"__module__": self.__name__, "__init__": _refuse})


def stub_vision_modules() -> None:
    """Install the stubs (before anything of SGLang is imported)."""
    for name in VISION_MODULES:
        sys.modules.setdefault(name, _VisionStub(name))
