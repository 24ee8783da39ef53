"""The ``nats`` extra (nats-py), loaded on first use: only a gateway given ``--nats`` needs it."""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

__all__ = ["EXTRA_HINT", "MissingExtraError", "load"]

EXTRA_HINT = (
    "kvsidecar gateway --nats needs the 'nats' extra (nats-py): pip install 'kvsidecar[nats]'"
)


class MissingExtraError(ImportError):
    """The ``nats`` extra is not installed."""


@cache
def load() -> Any:
    """The ``nats`` module, or ``MissingExtraError`` naming the extra to install."""
    try:
        return importlib.import_module("nats")
    except ImportError as exc:
        raise MissingExtraError(f"{EXTRA_HINT} ({exc})") from exc
