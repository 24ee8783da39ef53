"""Command-line options declared once, as fields of a config dataclass.

A field made with ``option(...)`` carries its default and type (the field's own) and its flag's
help and group (the metadata). ``OptionParser.add_options(cls)`` turns those fields into argparse
flags, so a default, a choice list or a conversion is written in one place, and
``OptionParser.build(cls, args)`` makes the dataclass from the parsed flags: the field's type
says how (``Path``, an ``Enum`` by value, a ``Literal`` of strings as its choices,
``tuple[X, ...]`` from a repeated flag, ``X | None`` for a flag that may be absent, ``bool``
from a switch). An option without a default is required: on the command line or in the config
file. ``ge=``/``gt=``/``le=``/``lt=`` bound a number (``kvcore.option_bounds``): checked on the
flag, in the config file and, through ``check_bounds`` in ``__post_init__``, in code.

``--config FILE`` reads the same options from TOML. Its keys are field names or flag names,
with dashes or underscores; its values, checked as the flags' are, become the flags' defaults,
so a flag on the command line wins. A key that names no option is an error, never ignored.

An option declared with ``env="KVSIDECAR_X"`` is also read from that environment variable
(its help ends with "(env KVSIDECAR_X)"), parsed and range-checked as the flag's value; a bad
one is an argparse error naming the variable, an empty one counts as unset. Where an option
is given in several places, the first of these wins: the command line, the environment, the
``--config`` file, the field's default.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import sys
import tomllib
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar, overload

from kvcore.option_bounds import Bounds
from kvcore.option_specs import OPTION_KEY, OptionMeta, OptionSpec, option_specs

__all__ = ["Bounds", "OptionParser", "check_bounds", "member", "option", "option_bounds",
           "option_of"]

_T = TypeVar("_T")
_E = TypeVar("_E", bound=enum.Enum)
_N = TypeVar("_N")


@overload
def option(
    default: _T,
    *,
    help: str,
    group: str,
    flag: str | None = None,
    aliases: Iterable[str] = (),
    metavar: str | None = None,
    parse: Callable[[str], object] | None = None,
    choices: Iterable[object] | None = None,
    default_text: str | None = None,
    secret: bool = False,
    env: str | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> _T: ...
@overload
def option(
    *,
    required: Literal[True],
    help: str,
    group: str,
    flag: str | None = None,
    aliases: Iterable[str] = (),
    metavar: str | None = None,
    parse: Callable[[str], object] | None = None,
    choices: Iterable[object] | None = None,
    secret: bool = False,
    env: str | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any: ...


def option(
    default: object = dataclasses.MISSING,
    *,
    help: str,
    group: str,
    flag: str | None = None,
    aliases: Iterable[str] = (),
    metavar: str | None = None,
    parse: Callable[[str], object] | None = None,
    choices: Iterable[object] | None = None,
    default_text: str | None = None,
    required: bool = False,
    secret: bool = False,
    env: str | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A dataclass field that is also a flag, ``--<name-with-dashes>`` unless ``flag`` says;
    ``aliases`` are more spellings of it (a flag renamed, its old name kept working).

    ``parse`` converts one command-line string when the field's type alone cannot (a URL into
    an address, "4GiB" into an int); its ``ValueError`` becomes an argparse error naming the
    flag. ``choices`` are the values allowed where the type cannot say (a ``str`` from a
    table's keys); an ``Enum`` field has its members' values already. The help gets
    "(default X)" from ``default``, or "(default: <default_text>)" where the default needs
    words (None meaning "learned", "unlimited"). A ``bool`` is a switch, off by default.

    ``required=True``, given instead of a default, makes a field without one: code that builds
    the dataclass must give it, and so must the command line or a ``--config`` file.
    ``secret=True`` keeps the value out of the dataclass's repr (a URL with a password).
    ``env`` names an environment variable that gives the value when the flag is not on the
    command line (over a ``--config`` file's), read and checked as the flag's; the help ends
    with "(env NAME)".

    ``ge``/``gt`` (at least, more than) and ``le``/``lt`` (at most, less than) bound a number,
    and each item of a repeated one; None, an optional option's absence, is always allowed.
    The flag and the config file refuse a value outside them, naming themselves and the
    range; code that builds the dataclass is refused by ``check_bounds`` in its
    ``__post_init__``."""
    if required == (default is not dataclasses.MISSING):
        raise TypeError("an option has a default or is required=True, one of the two")
    given = (ge, gt, le, lt)
    meta = OptionMeta(help, group, flag, metavar, parse, default_text, tuple(aliases),
                      None if choices is None else tuple(choices), required,
                      None if given == (None,) * 4 else Bounds(*given), env)
    if required:
        return dataclasses.field(repr=not secret, metadata={OPTION_KEY: meta})
    return dataclasses.field(default=default, repr=not secret, metadata={OPTION_KEY: meta})


def option_of(
    cls: type,
    name: str,
    *,
    group: str,
    help: str | None = None,
    default: object = dataclasses.MISSING,
    env: str | None = None,
) -> Any:
    """Option ``name`` of the config ``cls``, declared again in another command's config (the
    field's type is written there too): the same flag and spellings, choices, parsing and
    default, unless ``default`` gives this command's own. ``group``, ``help`` where the words
    differ, and ``env``, the variable that gives it (none unless named: how a command is
    deployed is its own), are this command's."""
    source = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if source is None or OPTION_KEY not in source.metadata:
        raise TypeError(f"{cls.__name__} has no option {name!r}")
    meta: OptionMeta = source.metadata[OPTION_KEY]
    meta = dataclasses.replace(meta, group=group, help=meta.help if help is None else help,
                               env=env)
    if default is not dataclasses.MISSING:  # this command's default, in its own words
        meta = dataclasses.replace(meta, default_text=None, required=False)
        return dataclasses.field(default=default, repr=source.repr, metadata={OPTION_KEY: meta})
    if meta.required:
        return dataclasses.field(repr=source.repr, metadata={OPTION_KEY: meta})
    return dataclasses.field(default=source.default, repr=source.repr, metadata={OPTION_KEY: meta})


def member(what: str, value: object, vocabulary: type[_E]) -> _E:
    """``value``'s member of ``vocabulary``, for a config's ``__post_init__`` (code that builds
    the config may give the plain string); ``ValueError`` naming ``what`` (the option) and its
    choices for any other value."""
    if isinstance(value, vocabulary):
        return value
    choices = [m.value for m in vocabulary]
    if value not in choices:
        raise ValueError(f"{what} must be {', '.join(map(str, choices[:-1]))} or "
                         f"{choices[-1]}, got {value!r}")
    return vocabulary(value)


def check_bounds(config: object) -> None:
    """Refuse, with a ``ValueError`` naming the field and its flag, an option of ``config``
    outside its ``ge=``/``gt=``/``le=``/``lt=``: the first line of every options dataclass's
    ``__post_init__``, so that code is held to the bounds a flag is."""
    for spec in option_specs(type(config)):
        if spec.meta.bounds is None:
            continue
        value = getattr(config, spec.name)
        for item in value if spec.repeat else (value,):
            try:
                spec.bounded(item)
            except ValueError as exc:
                raise ValueError(f"{spec.name} {exc} ({spec.flag})") from None


def option_bounds(cls: type) -> dict[str, Bounds]:
    """The bounds of ``cls``'s bounded options, by field name."""
    return {s.name: s.meta.bounds for s in option_specs(cls) if s.meta.bounds is not None}


class _Repeat(argparse.Action):
    """``append``, except that the first use replaces the default (a config file's list)
    instead of adding to it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        items = [] if current is None or current is self.default else list(current)
        items.append(values)
        setattr(namespace, self.dest, items)


class _BadSource(Exception):
    """A ``--config`` file or an environment variable gave a value its option refuses."""


class OptionParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose flags come from config dataclasses' fields, with
    ``--config FILE`` (TOML) giving their defaults."""

    def __init__(
        self, *args: Any, environ: Mapping[str, str] | None = None, **kwargs: Any
    ) -> None:
        """argparse's arguments; ``environ`` is where ``env=`` options are read (by default
        the process's environment, when the command line is parsed)."""
        super().__init__(*args, **kwargs)
        self._environ = environ
        self._specs: dict[str, OptionSpec] = {}  # by dest, which is the field's name
        self._keys: dict[str, str] = {}  # a config file's key, with underscores → dest
        self._groups: dict[str, argparse._ArgumentGroup] = {}
        self.add_argument(
            "--config",
            metavar="FILE",
            help="a TOML file of these options: keys are the flags' names without the leading "
            "dashes (dashes or underscores), a repeatable flag's value a list; flags given "
            "here, and the environment variables named '(env NAME)', override the file",
        )

    def add_options(self, cls: type) -> None:
        """A flag for each option of ``cls``, in the options' groups, in field order."""
        for spec in option_specs(cls):
            if spec.name in self._specs:
                raise ValueError(f"two options named {spec.name}")
            group = self._groups.get(spec.meta.group)
            if group is None:
                group = self._groups[spec.meta.group] = self.add_argument_group(spec.meta.group)
            kwargs: dict[str, Any] = {"dest": spec.name, "default": spec.raw_default,
                                      "help": spec.help, "required": spec.meta.required}
            if spec.kind is bool:
                kwargs["action"] = "store_true"
            else:
                if spec.repeat:
                    kwargs["action"] = _Repeat
                if spec.choices is not None:
                    kwargs["choices"] = list(spec.choices)
                if spec.kind in (int, float) and spec.meta.parse is None:
                    kwargs["type"] = spec.kind
                if spec.meta.metavar is not None:
                    kwargs["metavar"] = spec.meta.metavar
            group.add_argument(*spec.flags, **kwargs)
            self._specs[spec.name] = spec
            for key in (spec.name, *(f.lstrip("-").replace("-", "_") for f in spec.flags)):
                self._keys[key] = spec.name

    def build(self, cls: type[_T], args: argparse.Namespace, **given: object) -> _T:
        """``cls`` from parsed flags (and ``given``, its fields that are not options); a bad
        value or a ``ValueError`` of ``cls`` itself is an argparse error (exit 2)."""
        values = dict(given)
        for spec in option_specs(cls):
            try:
                values[spec.name] = spec.convert(getattr(args, spec.name))
            except ValueError as exc:
                self.error(f"argument {spec.flag}: {exc}")
        try:
            return cls(**values)
        except ValueError as exc:
            self.error(str(exc))

    @overload
    def parse_known_args(
        self, args: Iterable[str] | None = None, namespace: None = None
    ) -> tuple[argparse.Namespace, list[str]]: ...
    @overload
    def parse_known_args(
        self, args: Iterable[str] | None, namespace: _N
    ) -> tuple[_N, list[str]]: ...
    @overload
    def parse_known_args(self, *, namespace: _N) -> tuple[_N, list[str]]: ...

    def parse_known_args(
        self, args: Iterable[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        """argparse's, after a ``--config`` file's values became the flags' defaults."""
        argv = None if args is None else list(args)
        path = self._config_path(argv)
        try:
            if path is not None:
                self._give(self._read(path))  # the file's, then the environment's over them
            self._give(self._from_environment())
        except _BadSource as exc:
            if not self._asks_for_help(sys.argv[1:] if argv is None else argv):
                self.error(str(exc))
            # --help still answers, so an operator can read what the bad value should be
        return super().parse_known_args(argv, namespace)

    def _asks_for_help(self, argv: Sequence[str]) -> bool:
        """Whether ``argv`` holds ``-h`` or ``--help``, or a prefix of ``--help`` that
        argparse takes for it (one no other long flag starts with), before any ``--``."""
        flags = [f for action in self._actions for f in action.option_strings]
        for arg in argv:
            if arg == "--":
                return False
            if arg in ("-h", "--help"):
                return True
            if (self.allow_abbrev and len(arg) > 2 and "--help".startswith(arg)
                    and [f for f in flags if f.startswith(arg)] == ["--help"]):
                return True
        return False

    def _give(self, defaults: dict[str, object]) -> None:
        """``defaults`` (by dest) as the flags': a flag on the command line still wins."""
        self.set_defaults(**defaults)
        for action in self._actions:
            if action.dest in defaults:
                action.required = False  # the file or the environment gave it

    def _from_environment(self) -> dict[str, object]:
        """The ``env=`` options the environment gives, as the flags' raw values, by dest."""
        environ = os.environ if self._environ is None else self._environ
        values: dict[str, object] = {}
        for dest, spec in self._specs.items():
            name = spec.meta.env
            if name is None or not environ.get(name):
                continue  # unset, or set empty: as if unset
            try:
                values[dest] = spec.from_env(environ[name])
            except ValueError as exc:
                raise _BadSource(f"environment variable {name} (for {spec.flag}): {exc}") from exc
        return values

    def _config_path(self, argv: list[str] | None) -> str | None:
        pre = argparse.ArgumentParser(add_help=False, exit_on_error=False)
        pre.add_argument("--config")
        try:
            known, _ = pre.parse_known_args(argv)
        except argparse.ArgumentError:
            return None  # the full parse says what is wrong
        return typing.cast(str | None, known.config)

    def _read(self, path: str) -> dict[str, object]:
        """The file's options as the flags' defaults, by dest."""
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise _BadSource(f"--config {path}: {exc}") from exc
        defaults: dict[str, object] = {}
        for key, value in table.items():
            dest = self._keys.get(key.replace("-", "_"))
            if dest is None:
                raise _BadSource(f"--config {path}: unknown option {key!r} (keys are the "
                                 "flags' names without the leading dashes)")
            try:
                defaults[dest] = self._specs[dest].from_file(value)
            except ValueError as exc:
                raise _BadSource(f"--config {path}: {key}: {exc}") from exc
        return defaults
