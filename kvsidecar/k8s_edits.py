"""Edits to a parsed object: append to a list, add a key to a mapping; and the two ways
they are made, on the object itself (``apply_edits``) and as an RFC 6902 JSON Patch
(``json_patch``). ``kvsidecar.yaml_splice`` makes the same edits in a file's text.

Paths are tuples of mapping keys and list indices from the object's root.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["AddKey", "Append", "Edit", "Path", "apply_edits", "get_path", "json_patch"]

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Append:
    """Append ``value`` to the list at ``path`` (which exists)."""

    path: Path
    value: Any


@dataclass(frozen=True)
class AddKey:
    """Add ``key: value`` to the mapping at ``path`` (which lacks ``key``)."""

    path: Path
    key: str
    value: Any


Edit = Append | AddKey


def json_patch(edits: Sequence[Edit]) -> list[dict[str, Any]]:
    """The RFC 6902 operations of ``edits``, in order."""
    ops: list[dict[str, Any]] = []
    for edit in edits:
        match edit:
            case Append(path, value):
                ops.append({"op": "add", "path": _pointer((*path, "-")), "value": value})
            case AddKey(path, key, value):
                ops.append({"op": "add", "path": _pointer((*path, key)), "value": value})
    return ops


def apply_edits(obj: Any, edits: Sequence[Edit]) -> Any:
    """``obj`` (a parsed object, changed in place) with ``edits`` made; ``obj`` itself."""
    for edit in edits:
        target = get_path(obj, edit.path)
        match edit:
            case Append(_, value):
                target.append(copy.deepcopy(value))
            case AddKey(_, key, value):
                target[key] = copy.deepcopy(value)
    return obj


def _pointer(path: Path) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def get_path(obj: Any, path: Path) -> Any:
    for part in path:
        obj = obj[part]
    return obj
