"""kvcore.options: a dataclass field that is also a flag, and --config FILE (TOML)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from kvcore.options import OptionParser, option, option_of


class Color(enum.Enum):
    RED = "red"
    DARK_BLUE = "dark-blue"


@dataclass(frozen=True, slots=True, order=True)
class Point:
    x: int
    y: int

    @classmethod
    def parse(cls, text: str) -> Point:
        x, sep, y = text.partition(",")
        if not sep:
            raise ValueError(f"a point is X,Y: {text!r}")
        return cls(int(x), int(y))


@dataclass(frozen=True, slots=True)
class Toy:
    points: tuple[Point, ...] = option((), group="shapes", flag="--point", metavar="X,Y",
                                       parse=Point.parse, help="a point; repeat for more")
    color: Color = option(Color.RED, group="shapes", help="what color")
    scale: float = option(1.5, group="shapes", help="how big")
    count: int = option(20_000, group="numbers", help="how many")
    limit: int | None = option(None, group="numbers", help="at most", default_text="unlimited")
    out: Path | None = option(None, group="numbers", help="where")
    verbose: bool = option(False, group="numbers", help="say more")
    name: str = option("toy", group="numbers", help="what it is called")

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")


def _parser() -> OptionParser:
    p = OptionParser(prog="toy")
    p.add_options(Toy)
    return p


def _build(argv: list[str]) -> Toy:
    p = _parser()
    return p.build(Toy, p.parse_args(argv))


def test_defaults_come_from_the_fields() -> None:
    assert _build([]) == Toy()


def test_flags_convert_by_field_type() -> None:
    """Repeated flags become a tuple of parsed values, enums come by value, paths are Paths."""
    toy = _build(["--point", "1,2", "--point", "3,4", "--color", "dark-blue", "--scale", "2",
                  "--count", "3", "--limit", "7", "--out", "/tmp/x", "--verbose",
                  "--name", "big"])
    assert toy == Toy((Point(1, 2), Point(3, 4)), Color.DARK_BLUE, 2.0, 3, 7, Path("/tmp/x"),
                      True, "big")


def test_help_has_groups_choices_and_generated_defaults() -> None:
    """Each group once, in field order; "(default X)" from the field's default, words where
    the default needs them, nothing for an absent or off one."""
    text = _parser().format_help()
    assert text.index("shapes:") < text.index("numbers:")
    assert "--point X,Y" in text and "{red,dark-blue}" in text
    assert "what color (default red)" in text
    assert "how big (default 1.5)" in text
    assert "how many (default 20,000)" in text
    assert "at most (default: unlimited)" in text
    assert "where\n" in text and "say more\n" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--point", "1"], "argument --point: a point is X,Y: '1'"),
        (["--color", "green"], "argument --color: invalid choice: 'green'"),
        (["--count", "x"], "argument --count: invalid int value: 'x'"),
        (["--count", "-1"], "count must be >= 0, got -1"),
    ],
)
def test_bad_values_are_argparse_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A conversion's or the dataclass's ValueError exits 2 with its message."""
    with pytest.raises(SystemExit) as info:
        _build(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "toy.toml"
    path.write_text(text)
    return str(path)


def test_a_config_file_gives_defaults_and_flags_override_it(tmp_path: Path) -> None:
    """Keys by field or flag name, dashes or underscores; a flag given beats the file, and a
    repeated flag replaces the file's list instead of adding to it."""
    path = _write(tmp_path, 'point = ["1,2", "3,4"]\ncolor = "dark-blue"\nscale = 3\n'
                            'count = 5\nverbose = true\nout = "/tmp/o"\n')
    toy = _build(["--config", path])
    assert toy == Toy((Point(1, 2), Point(3, 4)), Color.DARK_BLUE, 3.0, 5, None, Path("/tmp/o"),
                      True, "toy")
    assert isinstance(toy.scale, float)
    toy = _build(["--count", "9", f"--config={path}", "--point", "5,6", "--color", "red"])
    assert (toy.count, toy.points, toy.color) == (9, (Point(5, 6),), Color.RED)
    assert _build(["--config", _write(tmp_path, 'points = ["7,8"]\n')]).points == (Point(7, 8),)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("colour = \"red\"\n", "unknown option 'colour'"),
        ("config = \"other.toml\"\n", "unknown option 'config'"),
        ("[numbers]\ncount = 1\n", "unknown option 'numbers'"),
        ("count = \"5\"\n", "count: expected an int, got '5'"),
        ("count = true\n", "count: expected an int, got True"),
        ("scale = \"big\"\n", "scale: expected a float, got 'big'"),
        ("verbose = 1\n", "verbose: expected a bool, got 1"),
        ("color = \"green\"\n", "color: must be one of red, dark-blue, got 'green'"),
        ("point = [\"1\"]\n", "point: a point is X,Y: '1'"),
        ("point = [1]\n", "point: expected a string, got 1"),
        ("count = -1\n", "count must be >= 0, got -1"),
        ("count = \n", "toy.toml: "),
    ],
)
def test_a_bad_config_file_is_refused(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unknown key, a value of the wrong type or one the flag would refuse: exit 2,
    naming the key."""
    with pytest.raises(SystemExit) as info:
        _build(["--config", _write(tmp_path, text)])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_config_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _build(["--config", str(tmp_path / "nope.toml")])
    assert "nope.toml" in capsys.readouterr().err


def test_fields_must_be_options_it_can_read() -> None:
    """A type the command line cannot give without parse=, or a switch on by default, is a
    mistake found when the parser is built."""

    @dataclass(frozen=True)
    class NoParse:
        point: Point | None = option(None, group="g", help="h")

    @dataclass(frozen=True)
    class OnSwitch:
        on: bool = option(True, group="g", help="h")

    for cls in (NoParse, OnSwitch):
        with pytest.raises(TypeError):
            OptionParser().add_options(cls)


SIZES = {"": 1, "k": 1024}


def _size(text: str) -> int:
    digits = text.rstrip("k")
    if not digits.isdigit():
        raise ValueError(f"not a size: {text!r}")
    return int(digits) * SIZES[text[len(digits):]]


@dataclass(frozen=True, slots=True)
class Job:
    """Required options (no default), a str from a table's keys, a renamed flag, a size."""

    name: str = option(required=True, group="job", help="what it is called")
    size: int = option(required=True, group="job", parse=_size, metavar="SIZE", help="how big")
    kind: str = option("b", group="job", choices=sorted({"b": 1, "a": 2}), help="which")
    spill_dir: Path | None = option(None, group="job", flag="--spill-tier-dir",
                                    aliases=("--spill-dir",), help="where")


def _job(argv: list[str]) -> Job:
    p = OptionParser(prog="job")
    p.add_options(Job)
    return p.build(Job, p.parse_args(argv))


def test_required_options_have_no_default_and_must_be_given(
    capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(TypeError):
        Job()  # type: ignore[call-arg]  # code must give them as well
    assert _job(["--name", "j", "--size", "2k"]) == Job("j", 2048)
    with pytest.raises(SystemExit) as info:
        _job(["--size", "2k"])
    assert info.value.code == 2
    assert "the following arguments are required: --name" in capsys.readouterr().err
    p = OptionParser(prog="job")
    p.add_options(Job)
    assert "[--name" not in p.format_usage() and "how big\n" in p.format_help()


def test_a_required_option_may_come_from_the_config_file(tmp_path: Path) -> None:
    """Sizes as a string (parsed) or as the field's type; a flag beats the file."""
    path = _write(tmp_path, 'name = "j"\nsize = "3k"\n')
    assert _job(["--config", path]) == Job("j", 3072)
    assert _job(["--config", path, "--name", "k"]) == Job("k", 3072)
    assert _job(["--config", _write(tmp_path, 'name = "j"\nsize = 5\n')]) == Job("j", 5)


def test_aliases_and_choices() -> None:
    """An alias is the same flag (and config key); choices= limits a str option."""
    assert _job(["--name", "j", "--size", "1", "--spill-dir", "/s", "--kind", "a"]) == Job(
        "j", 1, "a", Path("/s"))
    p = OptionParser(prog="job")
    p.add_options(Job)
    text = p.format_help()
    assert "--spill-tier-dir SPILL_DIR, --spill-dir SPILL_DIR" in text and "{a,b}" in text


@pytest.mark.parametrize(
    ("argv", "text", "message"),
    [
        (["--kind", "c"], "", "argument --kind: invalid choice: 'c'"),
        (["--size", "2x"], "", "argument --size: not a size: '2x'"),
        ([], 'name = "j"\nsize = true\n', "size: expected an int or a string, got True"),
        ([], 'name = "j"\nsize = "2x"\n', "size: not a size: '2x'"),
        ([], 'name = "j"\nsize = 1\nkind = "c"\n', "kind: must be one of a, b, got 'c'"),
        ([], 'name = "j"\nsize = 1\nspill-dir = 7\n', "spill-dir: expected a string, got 7"),
    ],
)
def test_bad_choices_and_sizes_are_refused(
    tmp_path: Path, argv: list[str], text: str, message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = ["--config", _write(tmp_path, text)] if text else ["--name", "j", "--size", "1"]
    with pytest.raises(SystemExit) as info:
        _job([*config, *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_an_option_has_a_default_or_is_required() -> None:
    with pytest.raises(TypeError):
        option(1, required=True, group="g", help="h")  # type: ignore[call-overload]
    with pytest.raises(TypeError):
        option(group="g", help="h")  # type: ignore[call-overload]


Mode = Literal["agg", "prefill", "decode"]


@dataclass(frozen=True, slots=True)
class Worker:
    """A vocabulary that a wire type already spells as a ``Literal``."""

    role: Mode = option("agg", group="worker", help="which pool")
    via: Literal["direct", "nats"] | None = option(None, group="worker", help="events from")


def test_a_literal_is_a_str_with_its_own_choices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its values are the flag's choices, on the command line and in the file."""
    p = OptionParser(prog="worker")
    p.add_options(Worker)
    assert "{agg,prefill,decode}" in p.format_help()
    assert p.build(Worker, p.parse_args(["--role", "decode"])) == Worker("decode")
    path = _write(tmp_path, 'role = "prefill"\nvia = "nats"\n')
    assert p.build(Worker, p.parse_args(["--config", path])) == Worker("prefill", "nats")
    for argv, message in ((["--role", "both"], "argument --role: invalid choice: 'both'"),
                          (["--config", _write(tmp_path, 'via = "x"\n')],
                           "via: must be one of direct, nats, got 'x'")):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
        assert message in capsys.readouterr().err


def test_a_literals_choices_are_its_own() -> None:
    @dataclass(frozen=True)
    class Twice:
        role: Mode = option("agg", group="g", choices=("agg",), help="h")

    with pytest.raises(TypeError):
        OptionParser().add_options(Twice)


@dataclass(frozen=True, slots=True)
class Copy:
    """Another command's config reusing ``Toy``'s options."""

    points: tuple[Point, ...] = option_of(Toy, "points", group="reused")
    limit: int | None = option_of(Toy, "limit", group="reused", help="at most, here")
    scale: float = option_of(Toy, "scale", group="reused", default=3.0)


def test_an_option_of_another_config_keeps_its_flag_parsing_and_default() -> None:
    """``option_of`` declares another config's option again: its flag, parsing and default
    (or this command's own default and words where given); a name that is no option is
    refused."""
    p = OptionParser(prog="copy")
    p.add_options(Copy)
    assert p.build(Copy, p.parse_args([])) == Copy((), None, 3.0)
    got = p.build(Copy, p.parse_args(["--point", "1,2", "--limit", "4", "--scale", "2"]))
    assert got == Copy((Point(1, 2),), 4, 2.0)
    text = p.format_help()
    assert "at most, here (default: unlimited)" in text and "how big (default 3)" in text
    with pytest.raises(SystemExit):
        p.build(Copy, p.parse_args(["--point", "nope"]))  # Point.parse's error, exit 2
    with pytest.raises(TypeError, match="no option 'missing'"):
        option_of(Toy, "missing", group="g")


@dataclass(frozen=True, slots=True, kw_only=True)
class Served:
    port: int = option(8000, group="server", ge=0, le=65535, env="TOY_PORT", help="listen here")
    mode: Color = option(Color.RED, group="server", env="TOY_MODE", help="what color")
    quiet: bool = option(False, group="server", env="TOY_QUIET", help="say less")
    image: str = option(required=True, group="server", env="TOY_IMAGE", help="what runs")
    name: str = option("toy", group="server", help="not read from the environment")


def _served(argv: list[str], environ: dict[str, str]) -> Served:
    p = OptionParser(prog="served", environ=environ)
    p.add_options(Served)
    return p.build(Served, p.parse_args(argv))


def test_the_command_line_beats_the_environment_which_beats_the_file(tmp_path: Path) -> None:
    """An ``env=`` option comes from the command line, else its variable, else the config
    file, else the field's default."""
    config = tmp_path / "served.toml"
    config.write_text('port = 7000\nimage = "from-file"\nmode = "dark-blue"\n')
    env = {"TOY_PORT": "9000", "TOY_IMAGE": "from-env", "TOY_QUIET": "yes"}
    assert _served(["--config", str(config), "--port", "1"], env).port == 1
    served = _served(["--config", str(config)], env)
    assert (served.port, served.image, served.quiet) == (9000, "from-env", True)
    assert served.mode is Color.DARK_BLUE  # the file's: the environment does not give it
    assert _served(["--config", str(config)], {}).port == 7000
    assert _served(["--image", "x"], {}) == Served(image="x")
    assert _served(["--image", "x"], {"TOY_PORT": ""}).port == 8000  # empty: unset


def test_the_environment_gives_a_required_option() -> None:
    """A required option set in its variable need not be on the command line."""
    assert _served([], {"TOY_IMAGE": "img", "TOY_MODE": "dark-blue"}).mode is Color.DARK_BLUE


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"TOY_PORT": "many"}, "environment variable TOY_PORT (for --port): invalid int "
         "value: 'many'"),
        ({"TOY_PORT": "70000"}, "environment variable TOY_PORT (for --port): must be in "
         "[0, 65535], got 70000"),
        ({"TOY_MODE": "green"}, "environment variable TOY_MODE (for --mode): must be one of "
         "red, dark-blue, got 'green'"),
        ({"TOY_QUIET": "maybe"}, "environment variable TOY_QUIET (for --quiet): expected one "
         "of 1, true, yes, on, 0, false, no, off, got 'maybe'"),
    ],
)
def test_a_bad_variable_is_an_error_naming_it(
    environ: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A variable's value is parsed and range-checked as the flag's; a bad one is refused,
    naming the variable and its flag, even when the flag is given too."""
    with pytest.raises(SystemExit) as info:
        _served(["--image", "x", "--port", "1"], environ)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_still_answers_with_a_bad_variable_or_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--help`` prints the options (what the bad value should have been) and exits 0,
    where any other command line is refused for the same variable or file."""
    config = tmp_path / "served.toml"
    config.write_text("colour = 1\n")
    for argv, environ in ((["--help"], {"TOY_PORT": "many"}),
                          (["--hel"], {"TOY_PORT": "many"}),  # argparse's abbreviation
                          (["--config", str(config), "-h"], {})):
        with pytest.raises(SystemExit) as info:
            _served(argv, environ)
        assert info.value.code == 0
        assert "what runs (env TOY_IMAGE)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        _served(["--image", "x", "--", "--help"], {"TOY_PORT": "many"})
    assert info.value.code == 2


def test_the_help_names_the_variable() -> None:
    """An ``env=`` option's help ends with "(env NAME)"; other options' do not."""
    p = OptionParser(prog="served", environ={})
    p.add_options(Served)
    helps = {a.dest: a.help for a in p._actions}
    assert helps["port"] == "listen here (default 8000; must be in [0, 65535]) (env TOY_PORT)"
    assert helps["image"] == "what runs (env TOY_IMAGE)"
    assert helps["name"] == "not read from the environment (default toy)"


def test_a_repeated_option_is_not_read_from_the_environment() -> None:
    """``env=`` on a ``tuple[X, ...]`` option is refused when the class is first read."""

    @dataclass(frozen=True)
    class Many:
        items: tuple[str, ...] = option((), group="g", env="TOY_ITEMS", help="items")

    with pytest.raises(TypeError, match="not read from the environment"):
        OptionParser(prog="many").add_options(Many)


def test_an_option_of_another_config_reads_only_its_own_variable() -> None:
    """``option_of`` keeps no variable of the source's: a command names its own, if any."""

    @dataclass(frozen=True)
    class Mirror:
        port: int = option_of(Served, "port", group="g")
        image: str = option_of(Served, "image", group="g", default="img", env="MIRROR_IMAGE")

    p = OptionParser(prog="mirror", environ={"TOY_PORT": "1", "MIRROR_IMAGE": "mine"})
    p.add_options(Mirror)
    assert p.build(Mirror, p.parse_args([])) == Mirror(port=8000, image="mine")
