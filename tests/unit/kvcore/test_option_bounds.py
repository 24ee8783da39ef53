"""An option's range, declared once (``option(ge=, gt=, le=, lt=)``), is held on every way a
config is made: the flag, the ``--config`` file and the dataclass built in code."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvcore.options import Bounds, OptionParser, check_bounds, option, option_bounds, option_of
from tests.support.options import refusal


@dataclass(frozen=True, slots=True)
class Gauge:
    """Inclusive and exclusive bounds, on an int, a float, an optional float and a repeat."""

    port: int = option(0, group="g", ge=0, le=65535, help="listen here")
    timeout_s: float = option(1.0, group="g", gt=0, help="wait this long")
    share: float | None = option(None, group="g", gt=0, le=1, help="of all")
    below: int = option(0, group="g", lt=10, help="under ten")
    sizes: tuple[int, ...] = option((), group="g", flag="--size", ge=1, help="each one")

    def __post_init__(self) -> None:
        check_bounds(self)


def _parser() -> OptionParser:
    p = OptionParser(prog="gauge")
    p.add_options(Gauge)
    return p


def _build(argv: list[str]) -> Gauge:
    p = _parser()
    return p.build(Gauge, p.parse_args(argv))


def test_values_on_an_inclusive_bound_and_inside_an_exclusive_one_pass() -> None:
    """ge/le admit the bound itself, gt/lt only what lies beyond it; None is an optional
    option's absence, never out of range."""
    gauge = _build(["--port", "65535", "--timeout-s", "1e-9", "--share", "1", "--below", "9",
                    "--size", "1", "--size", "4"])
    assert gauge == Gauge(65535, 1e-9, 1.0, 9, (1, 4))
    assert _build(["--port", "0"]).share is None


def test_help_shows_each_range_after_the_default() -> None:
    """--help says the range a flag takes, in the words its refusal uses."""
    text = " ".join(_parser().format_help().split())  # argparse wraps lines at will
    assert "listen here (default 0; must be in [0, 65535])" in text
    assert "wait this long (default 1; must be > 0)" in text
    assert "of all (must be in (0, 1])" in text
    assert "each one (must be >= 1)" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "65536"], "argument --port: must be in [0, 65535], got 65536"),
        (["--port", "-1"], "argument --port: must be in [0, 65535], got -1"),
        (["--timeout-s", "0"], "argument --timeout-s: must be a finite number > 0, got 0.0"),
        (["--timeout-s", "inf"], "argument --timeout-s: must be a finite number > 0, got inf"),
        (["--timeout-s", "nan"], "argument --timeout-s: must be a finite number > 0, got nan"),
        (["--share", "0"], "argument --share: must be in (0, 1], got 0.0"),
        (["--share", "1.5"], "argument --share: must be in (0, 1], got 1.5"),
        (["--below", "10"], "argument --below: must be < 10, got 10"),
        (["--size", "2", "--size", "0"], "argument --size: must be >= 1, got 0"),
    ],
)
def test_a_flag_out_of_range_is_an_argparse_error_naming_it_and_the_range(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in refusal(lambda: _build(argv), capsys)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("port = 70000\n", ": port: must be in [0, 65535], got 70000"),
        ("timeout-s = 0\n", ": timeout-s: must be a finite number > 0, got 0.0"),
        ("share = 0\n", ": share: must be in (0, 1], got 0.0"),
        ("size = [3, 0]\n", ": size: must be >= 1, got 0"),
    ],
)
def test_a_config_file_value_out_of_range_is_refused_naming_the_file_and_key(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gauge.toml"
    path.write_text(text)
    assert f"--config {path}{message}" in refusal(lambda: _build(["--config", str(path)]), capsys)


def test_a_config_file_value_in_range_is_taken(tmp_path: Path) -> None:
    path = tmp_path / "gauge.toml"
    path.write_text("port = 65535\nshare = 1\nsize = [1]\n")
    assert _build(["--config", str(path)]) == Gauge(port=65535, share=1.0, sizes=(1,))


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"port": 70000}, "port must be in [0, 65535], got 70000 (--port)"),
        ({"timeout_s": math.inf}, "timeout_s must be a finite number > 0, got inf (--timeout-s)"),
        ({"share": 0.0}, "share must be in (0, 1], got 0.0 (--share)"),
        ({"below": 10}, "below must be < 10, got 10 (--below)"),
        ({"sizes": (1, 0)}, "sizes must be >= 1, got 0 (--size)"),
        ({"port": "80"}, "port must be in [0, 65535], got '80' (--port)"),
    ],
)
def test_code_is_held_to_the_bounds_a_flag_is(given: dict[str, object], message: str) -> None:
    """A config built in code outside a bound: ValueError naming the field and its flag."""
    with pytest.raises(ValueError) as info:
        Gauge(**given)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_an_option_of_another_config_keeps_its_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    """``option_of`` carries the range with the flag: the other command refuses alike."""

    @dataclass(frozen=True, slots=True)
    class Copy:
        port: int = option_of(Gauge, "port", group="copy", default=8000)

        def __post_init__(self) -> None:
            check_bounds(self)

    assert option_bounds(Copy) == {"port": Bounds(ge=0, le=65535)}
    p = OptionParser(prog="copy")
    p.add_options(Copy)
    with pytest.raises(SystemExit):
        p.build(Copy, p.parse_args(["--port", "70000"]))
    assert "argument --port: must be in [0, 65535], got 70000" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"port must be in \[0, 65535\], got -1 \(--port\)"):
        Copy(port=-1)


def test_bounds_that_make_no_sense_are_refused_where_declared() -> None:
    """Two lower (or upper) bounds, an empty range, a bound on a str, a default out of its
    own range: a mistake found by ``option()`` or when the parser is built."""
    with pytest.raises(TypeError, match="ge= or gt="):
        option(1, group="g", help="h", ge=0, gt=0)
    with pytest.raises(TypeError, match="le= or lt="):
        option(1, group="g", help="h", le=2, lt=2)
    with pytest.raises(TypeError, match="no number is in"):
        option(1, group="g", help="h", ge=2, le=1)

    @dataclass(frozen=True)
    class OnAString:
        name: str = option("x", group="g", help="h", ge=1)

    @dataclass(frozen=True)
    class DefaultOutside:
        port: int = option(-1, group="g", help="h", ge=0)

    for cls, message in ((OnAString, "an int or a float"), (DefaultOutside, "default -1")):
        with pytest.raises(TypeError, match=message):
            OptionParser().add_options(cls)


def test_the_words_for_each_kind_of_range() -> None:
    assert Bounds(ge=1, le=4096).allowed(real=False) == "in [1, 4096]"
    assert Bounds(gt=0.0, lt=1.5).allowed(real=True) == "in (0, 1.5)"
    assert Bounds(ge=0).allowed(real=True) == "a finite number >= 0"
    assert Bounds(le=10).allowed(real=False) == "<= 10"
    assert not Bounds(ge=0).admits(True)  # a switch is no number
