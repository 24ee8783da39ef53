"""Reading a container's shell script: which token is the script, and its simple commands
as a POSIX shell splits them (quotes, escapes, continuations, operators, redirections)."""

from __future__ import annotations

import pytest

from kvsidecar.shell_script import commands, shell_script


@pytest.mark.parametrize(
    ("tokens", "script"),
    [(["sh", "-c", "S"], "S"),
     (["/bin/bash", "-lc", "S", "argv0", "x"], "S"),
     (["bash", "-euxo", "pipefail", "-c", "S"], "S"),
     (["bash", "-o", "pipefail", "-e", "-c", "S"], "S"),
     (["bash", "--login", "-c", "S"], "S"),
     (["bash", "start.sh"], None),
     (["bash", "-c"], None),
     (["python3", "-c", "S"], None),
     ([], None)],
)
def test_the_script_token(tokens: list[str], script: str | None) -> None:
    """The token after a shell's -c (in any option cluster) is the script; a script file,
    or a -c that is not a shell's, is none."""
    assert shell_script(tokens) == script


def test_words_and_commands() -> None:
    """Commands end at newlines and operators; quotes and escapes are removed; comments,
    redirections and their targets are no words; continuations join lines."""
    script = (
        "set -e  # strict\n"
        "A=1 exec python3 -m srv \\\n"
        "  --cfg '{\"a\": 1}' --name \"x \\\"y\\\"\" --esc a\\ b 2>&1 | tee /log &\n"
        "echo ok && echo $(date +%s) > /dev/null; wait\n"
    )
    found = commands(script)
    assert [c.words for c in found] == [
        ("set", "-e"),
        ("A=1", "exec", "python3", "-m", "srv", "--cfg", '{"a": 1}', "--name", 'x "y"',
         "--esc", "a b"),
        ("tee", "/log"),
        ("echo", "ok"),
        ("echo", "$(date +%s)"),
        ("wait",),
    ]
    assert [c.line for c in found] == [1, 2, 3, 4, 4, 4]
    assert found[1].text.startswith("A=1 exec") and found[1].text.endswith("a\\ b")


def test_variables_and_substitutions_stay_as_written() -> None:
    """Nothing is expanded: $VAR, ${VAR} and a nested $(...) with quotes come out whole."""
    (command,) = commands('srv --port "${PORT}" --x $(f "$(g \')\')") --y $Y')
    assert command.words == ("srv", "--port", "${PORT}", "--x", "$(f \"$(g ')')\")",
                             "--y", "$Y")


def test_blocks_and_pipelines() -> None:
    """if/then/fi and subshells split into their commands; the keyword stays a word."""
    found = commands("if [ -f x ]; then (cd /a && srv --p 1); fi")
    assert [c.words for c in found] == [
        ("if", "[", "-f", "x", "]"), ("then",), ("cd", "/a"), ("srv", "--p", "1"), ("fi",),
    ]
