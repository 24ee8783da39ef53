"""Helpers for the tests of commands whose flags are config dataclass fields
(``kvcore.options``): a field's default as its flag holds it, and a config as a TOML file."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

__all__ = ["as_flag_default", "config_toml", "refusal"]


def as_flag_default(value: object) -> object:
    """A field's value as the command line holds it: an enum's value, a path's string, None
    for an empty tuple or a required field's missing default."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    return None if value == () or value is dataclasses.MISSING else value


def config_toml(values: Mapping[str, object]) -> str:
    """``values`` (a config's fields by name) as a ``--config`` file: enums by value, paths as
    strings, tuples as lists of strings, None left out."""
    lines = []
    for key, given in values.items():
        value = as_flag_default(given) if given != () else []
        if isinstance(value, bool):
            lines.append(f"{key} = {str(value).lower()}")
        elif isinstance(value, int | float):
            lines.append(f"{key} = {value}")
        elif isinstance(value, tuple | list):
            lines.append(f"{key} = {json.dumps([str(v) for v in value])}")
        elif value is not None:
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def refusal(build: Callable[[], object], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``build`` (a command's ``from_args``) writes to stderr as it exits 2."""
    with pytest.raises(SystemExit) as info:
        build()
    assert info.value.code == 2
    return capsys.readouterr().err
