"""Flags on an engine's command line, read as argparse (SGLang) and click (TensorRT-LLM)
read them: ``--flag value`` or ``--flag=value``, the first occurrence winning."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["flag_value", "has_flag"]


def has_flag(tokens: Sequence[str], flag: str) -> bool:
    return any(t == flag or t.startswith(flag + "=") for t in tokens)


def flag_value(tokens: Sequence[str], flag: str) -> str | None:
    for i, token in enumerate(tokens):
        if token == flag and i + 1 < len(tokens):
            return tokens[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    return None
