"""The ``nats`` extra (nats-py), loaded on first use: only a gateway given ``--nats`` and a
sidecar given ``--events-via nats`` need it."""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

__all__ = ["MissingExtraError", "load"]


class MissingExtraError(ImportError):
    """The ``nats`` extra is not installed."""


@cache
def _module() -> Any:
    return importlib.import_module("nats")


def load(command: str) -> Any:
    """The ``nats`` module, or ``MissingExtraError`` naming the extra ``command`` needs."""
    try:
        return _module()
    except ImportError as exc:
        raise MissingExtraError(f"{command} needs the 'nats' extra (nats-py): "
                                f"pip install 'kvsidecar[nats]' ({exc})") from exc
