"""The engine's command line in its container: the words its flags are read from.

In exec form (``command: [python3, -m, sglang.launch_server, ...]``) that is the container's
``command`` and ``args``, and flags the sidecar needs can be appended to them. Started by a
shell (``[bash, -c, SCRIPT]``, or ``command: [bash, -c]`` with the script in ``args``) it is
the one simple command of the script that runs the engine, from the engine's own word on
(what comes before is ``exec``, ``VAR=value``, ``numactl ...``, the interpreter). That line
is read but never edited: when it lacks a flag, the user is told the exact words to add and
where (``script_edit``), and the next injection finds them there.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvsidecar.engine_flags import flag_value
from kvsidecar.shell_script import Command, commands, shell_script

__all__ = ["EngineCommand", "engine_command", "engine_port", "script_edit"]

# $(VAR) (Kubernetes expands it in command and args), ${VAR} and $VAR (a shell's).
_VARIABLE = re.compile(r"\$\((\w+)\)|\$\{(\w+)\}|\$(\w+)")
_SHOWN = 72  # how much of a script line an error message quotes


@dataclass(frozen=True)
class EngineCommand:
    words: list[str]
    script_line: Command | None = None  # set when a shell script starts the engine


def engine_command(
    tokens: Sequence[str], is_engine_word: Callable[[str], bool], engine: str
) -> EngineCommand:
    """The engine's words among a container's ``tokens`` (its command, then its args).

    ``is_engine_word`` tells the word that names the engine (``sglang.launch_server``,
    ``trtllm-serve``). Raises ``ValueError`` when a shell script runs no such command, or
    several.
    """
    script = shell_script(tokens)
    if script is None:
        return EngineCommand(list(tokens))
    found: list[tuple[Command, list[str]]] = []
    for line in commands(script):
        start = next((i for i, w in enumerate(line.words) if is_engine_word(w)), None)
        if start is not None:
            found.append((line, list(line.words[start:])))
    if len(found) == 1:
        line, words = found[0]
        return EngineCommand(words, line)
    shell = " ".join(tokens[: tokens.index(script)])
    if not found:
        raise ValueError(
            f"it starts its engine through a shell ({shell} '...'), and no command of the "
            f"script runs {engine} as far as kvsidecar can read it: start the engine in the "
            "script itself (e.g. exec python3 -m sglang.launch_server ...) or in exec form "
            "(command: [python3, -m, sglang.launch_server, ...])"
        )
    lines = ", ".join(str(line.line) for line, _ in found)
    raise ValueError(
        f"its shell script runs {engine} in several commands (lines {lines}), so kvsidecar "
        "cannot tell which one serves: give each its own container or pod"
    )


def script_edit(container: str, line: Command, flags: Sequence[str]) -> str:
    """The refusal for a script whose engine line lacks ``flags``: the exact edit to make."""
    last = line.text.splitlines()[-1].strip()
    shown = last if len(last) <= _SHOWN else "..." + last[-_SHOWN:]
    return (
        f"container {container!r} starts its engine from a shell script, which kvsidecar "
        "reads but never rewrites, and its engine command (starting on line "
        f"{line.line} of the script) lacks flags the sidecar needs. Append them to that "
        f"command, after `{shown}`: "
        + " ".join(_shell_quote(f) for f in flags)
        + " (then the sidecar is added and the script left as it is)"
    )


def engine_port(words: Sequence[str], default: int, env: Any) -> str:
    """The engine's ``--port``, a variable in it resolved from the container's literal
    ``env`` values; ``ValueError`` when it cannot be."""
    port = flag_value(words, "--port") or str(default)
    if "$" not in port:
        return port
    values = {
        e.get("name"): e.get("value")
        for e in (env if isinstance(env, list) else [])
        if isinstance(e, Mapping)
    }
    match = _VARIABLE.fullmatch(port)
    value = values.get(next(g for g in match.groups() if g)) if match else None
    if not isinstance(value, str) or not value.isdigit():
        raise ValueError(
            f"the engine's --port is {port}, which kvsidecar cannot resolve (it reads only "
            "literal values of the container's env): write the port as a number"
        )
    return value


def _shell_quote(word: str) -> str:
    if word and all(ch.isalnum() or ch in "-_./:=" for ch in word):
        return word
    return "'" + word.replace("'", "'\\''") + "'"
