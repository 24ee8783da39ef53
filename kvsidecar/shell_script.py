"""The simple commands of a container's shell script, read well enough to find the engine's.

Manifests often start the engine as ``command: [bash, -c]`` with a script in ``args``: a
few ``export``s, a download, then ``exec python3 -m sglang.launch_server \\`` over several
lines. kvsidecar never rewrites such a script (quoting, ``set -e`` and traps make any edit a
guess), but it must *read* it: whether the engine already has the KV-event flags, its port
and its P/D role. This module splits a script into simple commands as a POSIX shell would:
quotes, backslash escapes and line continuations are honoured, ``;`` ``&&`` ``||`` ``|``
``&`` newlines and parentheses end a command, comments are dropped, and redirections
(``2>&1``, ``> log``) are not words. What it does not do is expand anything: ``$PORT``,
``$(...)`` and globs stay as written. That is all an engine's flags need.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Command", "commands", "shell_script"]

_SHELLS = {"sh", "bash", "dash", "ash", "zsh"}
_BLANK = " \t"
_ENDS = "\n;&|()"  # what ends a simple command at the top level
_REDIRECT = "<>"


@dataclass(frozen=True)
class Command:
    """One simple command: its words unquoted, where it starts, and its text."""

    words: tuple[str, ...]
    line: int  # 1-based, of the first word
    text: str  # the script's text from the first word to the last, continuations included


def shell_script(tokens: Sequence[str]) -> str | None:
    """The script of ``sh -c SCRIPT [NAME ARGS...]`` (also ``bash -lc``, ``bash -euo
    pipefail -c``, ``/bin/sh -c``); ``None`` when ``tokens`` do not run a shell's ``-c``."""
    if not tokens or posixpath.basename(tokens[0]) not in _SHELLS:
        return None
    i = 1
    while i < len(tokens):
        token = tokens[i]
        if token in ("--", "-") or not token.startswith(("-", "+")):
            return None  # a script file, or no -c at all
        if not token.startswith("--") and "c" in token[1:]:
            return tokens[i + 1] if i + 1 < len(tokens) else None
        # -o NAME and -O NAME (alone or ending a cluster such as -euxo) take the next token
        i += 2 if not token.startswith("--") and token[-1] in "oO" else 1
    return None


def commands(script: str) -> list[Command]:
    """The simple commands of ``script``, in order (empty ones left out)."""
    return _Reader(script).read()


class _Reader:
    """A one-pass tokenizer: words with their spans, command boundaries, redirections."""

    def __init__(self, script: str) -> None:
        self.s = script
        self.i = 0
        self.found: list[Command] = []
        self.words: list[tuple[str, int, int]] = []  # (word, start, end) of this command
        self.redirect_target = False  # the next word is a redirection's file, not a word

    def read(self) -> list[Command]:
        s = self.s
        while self.i < len(s):
            ch = s[self.i]
            if ch in _BLANK:
                self.i += 1
            elif s.startswith("\\\n", self.i):
                self.i += 2
            elif ch == "#":
                end = s.find("\n", self.i)
                self.i = len(s) if end < 0 else end
            elif ch in _REDIRECT or (ch == "&" and s.startswith(">", self.i + 1)):
                self._redirection()
            elif ch in _ENDS:
                self._end()
                self.i += 1
            else:
                self._word()
        self._end()
        return self.found

    def _end(self) -> None:
        if self.words:
            start, end = self.words[0][1], self.words[-1][2]
            line = self.s.count("\n", 0, start) + 1
            self.found.append(
                Command(tuple(w for w, _, _ in self.words), line, self.s[start:end])
            )
        self.words = []
        self.redirect_target = False

    def _redirection(self) -> None:
        """``>``, ``2>&1``, ``&> f``, ``<<<``: the operator, then its target is no word."""
        previous = self.words[-1] if self.words else None
        if previous is not None and previous[2] == self.i and previous[0].isdigit():
            self.words.pop()  # the file descriptor of ``2>``
        while self.i < len(self.s) and self.s[self.i] in "<>&|-":
            self.i += 1
        self.redirect_target = True

    def _word(self) -> None:
        s, start = self.s, self.i
        out: list[str] = []
        while self.i < len(s):
            ch = s[self.i]
            if ch in _BLANK or ch in _ENDS or ch in _REDIRECT:
                break
            if ch == "\\":
                if s.startswith("\\\n", self.i):
                    self.i += 2
                    continue
                out.append(s[self.i + 1 : self.i + 2])
                self.i += 2
            elif ch == "'":
                end = s.find("'", self.i + 1)
                end = len(s) if end < 0 else end
                out.append(s[self.i + 1 : end])
                self.i = end + 1
            elif ch == '"':
                out.append(self._double_quoted())
            elif ch == "$" and s.startswith(("$(", "${"), self.i):
                out.append(self._balanced())
            elif ch == "`":
                end = s.find("`", self.i + 1)
                end = len(s) if end < 0 else end
                out.append(s[self.i : end + 1])
                self.i = end + 1
            else:
                out.append(ch)
                self.i += 1
        if self.redirect_target:
            self.redirect_target = False
        else:
            self.words.append(("".join(out), start, min(self.i, len(s))))

    def _double_quoted(self) -> str:
        s = self.s
        out: list[str] = []
        self.i += 1
        while self.i < len(s) and s[self.i] != '"':
            ch = s[self.i]
            if ch == "\\" and self.i + 1 < len(s) and s[self.i + 1] in '"\\$`\n':
                if s[self.i + 1] != "\n":
                    out.append(s[self.i + 1])
                self.i += 2
            elif ch == "$" and s.startswith(("$(", "${"), self.i):
                out.append(self._balanced())
            else:
                out.append(ch)
                self.i += 1
        self.i += 1
        return "".join(out)

    def _balanced(self) -> str:
        """``$(...)`` or ``${...}``, kept as written (nesting and quotes inside honoured)."""
        s, start = self.s, self.i
        opener, closer = s[self.i + 1], ")" if s[self.i + 1] == "(" else "}"
        depth = 0
        while self.i < len(s):
            ch = s[self.i]
            if ch == "\\":
                self.i += 2
                continue
            if ch == "'" and opener == "(":
                end = s.find("'", self.i + 1)
                self.i = len(s) if end < 0 else end + 1
                continue
            if ch == opener:
                depth += 1
            elif ch == closer:
                depth -= 1
                if depth == 0:
                    self.i += 1
                    break
            self.i += 1
        return s[start : self.i]
