"""What ``kvcore.options`` reads from a config dataclass: each ``option()`` field's metadata
(``OptionMeta``) and, resolved against the field's type, its flag and the shape of its values
(``OptionSpec``), with the mistakes a declaration can make refused when it is first read."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

from kvcore.option_bounds import Bounds

__all__ = ["OPTION_KEY", "OptionMeta", "OptionSpec", "option_specs"]

OPTION_KEY = "kvcore.option"  # where a field's metadata holds its OptionMeta
_SCALARS = (bool, int, float, str, Path)


@dataclasses.dataclass(frozen=True, slots=True)
class OptionMeta:
    """An option as ``option()`` declared it, kept in its field's metadata."""

    help: str
    group: str
    flag: str | None
    metavar: str | None
    parse: Callable[[str], object] | None
    default_text: str | None
    aliases: tuple[str, ...]
    choices: tuple[object, ...] | None
    required: bool
    bounds: Bounds | None
    env: str | None = None  # the environment variable that gives it, when not on the command line


@dataclasses.dataclass(frozen=True, slots=True)
class OptionSpec:
    """One option, resolved: its flag and the shape of its values."""

    name: str
    flag: str
    kind: Any  # bool, int, float, str, Path, an Enum, or what ``parse`` returns
    optional: bool  # X | None
    repeat: bool  # tuple[X, ...]: the flag may be given many times
    default: object
    meta: OptionMeta

    @property
    def flags(self) -> tuple[str, ...]:
        """Its option strings: the flag, then its aliases."""
        return (self.flag, *self.meta.aliases)

    @property
    def raw_default(self) -> object:
        """The default as argparse holds it (the command line's form: enum values, strings)."""
        if self.repeat or self.meta.required:
            return None
        if isinstance(self.default, enum.Enum):
            return self.default.value
        if isinstance(self.default, Path):
            return str(self.default)
        return self.default

    def convert(self, raw: object) -> object:
        """argparse's (or the config file's) value as the field's; ``ValueError`` says why not."""
        if self.repeat:
            return tuple(self.bounded(self._one(v))
                         for v in typing.cast(Iterable[object], raw or ()))
        if raw is None or (raw == "" and self.optional and self.kind is Path):
            return None
        return self.bounded(self._one(raw))

    def bounded(self, value: object) -> object:
        """``value`` (one item of a repeated option), unless outside the option's bounds:
        ``ValueError`` "must be <range>, got <value>"; None, an absence, is never outside."""
        if self.meta.bounds is not None and value is not None:
            self.meta.bounds.check(value, real=self.kind is float)
        return value

    def _one(self, value: object) -> object:
        if self.meta.parse is not None:
            return self.meta.parse(value) if isinstance(value, str) else value
        if isinstance(self.kind, type) and issubclass(self.kind, enum.Enum):
            return self.kind(value)
        if self.kind is Path:
            return Path(typing.cast(str, value))
        return value

    def from_file(self, value: object) -> object:
        """A TOML value as the flag's raw value, checked as the flag's would be."""
        if self.repeat:
            items = value if isinstance(value, list) else [value]
            return [self._file_scalar(v) for v in items]
        return self._file_scalar(value)

    def _file_scalar(self, value: object) -> object:
        kind = self.kind
        if self.meta.parse is not None and isinstance(value, str):
            ok = True  # what a flag would get; parse checks it below
        elif kind is bool:
            ok = isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if isinstance(value, int | float):
                value = float(value)  # TOML's 2 is an int; the flag's would be 2.0
        else:
            ok = isinstance(value, str)
        if not ok:
            expected = _kind_name(kind)
            if self.meta.parse is not None and expected != "a string":
                expected += " or a string"  # "4GiB" as well as 4294967296
            raise ValueError(f"expected {expected}, got {value!r}")
        self._check_choice(value, value)
        self.bounded(self._one(value))  # a parse error or a bound is the file's error
        return value

    def _check_choice(self, value: object, given: object) -> None:
        """Refuse a raw ``value`` outside the choices (``given``: as the user wrote it); an
        option with its own ``parse`` checks its values there."""
        choices = self.choices
        if choices is not None and self.meta.parse is None and value not in choices:
            raise ValueError(f"must be one of {', '.join(map(str, choices))}, got {given!r}")

    @property
    def choices(self) -> tuple[object, ...] | None:
        """The raw values allowed: ``choices=``'s, or an ``Enum``'s members' values."""
        if self.meta.choices is not None:
            return self.meta.choices
        if isinstance(self.kind, type) and issubclass(self.kind, enum.Enum):
            return tuple(m.value for m in self.kind)
        return None

    @property
    def help(self) -> str:
        """The declared help, then in parentheses the default and the range:
        "listen here (default 8000; must be in [0, 65535])"."""
        text = self.meta.help.replace("%", "%%")  # argparse %-formats help strings
        bounds = self.meta.bounds
        notes = [note for note in (
            self._default_note(),
            None if bounds is None else f"must be {bounds.allowed(real=False)}") if note]
        text = f"{text} ({'; '.join(notes)})".lstrip() if notes else text
        return text if self.meta.env is None else f"{text} (env {self.meta.env})".lstrip()

    def from_env(self, text: str) -> object:
        """An environment variable's text as the flag's raw value, parsed and checked as the
        flag's would be (a switch reads 1/true/yes/on or 0/false/no/off)."""
        if self.kind is bool:
            word = text.strip().lower()
            if word not in _TRUE + _FALSE:
                raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}, got {text!r}")
            return word in _TRUE
        raw: object = text
        if self.kind in (int, float) and self.meta.parse is None:
            try:
                raw = self.kind(text)
            except ValueError:
                raise ValueError(f"invalid {self.kind.__name__} value: {text!r}") from None
        self._check_choice(raw, text)
        self.convert(raw)  # a parse error or a bound is the variable's error
        return raw

    def _default_note(self) -> str | None:
        """"default X" for the help; None for a required option (argparse's usage line shows
        it without brackets) and for an absent, off or empty default (its help says what
        that means)."""
        if self.meta.required:
            return None
        if self.meta.default_text is not None:
            return f"default: {self.meta.default_text}"
        if self.default is None or self.default is False or self.default == ():
            return None
        return f"default {_show(self.default)}"


def _kind_name(kind: Any) -> str:
    if kind in _SCALARS:
        return "a string" if kind is Path else f"{'an' if kind is int else 'a'} {kind.__name__}"
    return "a string"


def _show(value: object) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


_READ_ONCE: dict[type, tuple[OptionSpec, ...]] = {}  # a class's options, read once (~3 ms)


def option_specs(cls: type) -> tuple[OptionSpec, ...]:
    """The options among ``cls``'s fields, in declaration order (``check_bounds`` asks each
    time a config is made)."""
    specs = _READ_ONCE.get(cls)
    if specs is None:
        specs = _READ_ONCE[cls] = _read(cls)
    return specs


def _read(cls: type) -> tuple[OptionSpec, ...]:
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(OPTION_KEY)
        if meta is None:
            continue
        if f.default is dataclasses.MISSING and not meta.required:
            raise TypeError(f"{cls.__name__}.{f.name}: an option needs a default")
        kind, optional, repeat = _shape(hints[f.name])
        if typing.get_origin(kind) is Literal:  # a vocabulary the wire types already name
            values = typing.get_args(kind)
            if meta.choices is not None or not all(isinstance(v, str) for v in values):
                raise TypeError(f"{cls.__name__}.{f.name}: a Literal option is of strings, "
                                "its choices its own")
            kind, meta = str, dataclasses.replace(meta, choices=values)
        spec = OptionSpec(f.name, meta.flag or "--" + f.name.replace("_", "-"), kind,
                          optional, repeat, f.default, meta)
        _check(cls, spec)
        specs.append(spec)
    return tuple(specs)


def _shape(hint: Any) -> tuple[Any, bool, bool]:
    """``X``, ``X | None`` or ``tuple[X, ...]`` → (X, optional, repeat)."""
    optional = False
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (types.UnionType, typing.Union) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"an option is one type, or that type | None: {hint!r}")
        hint, optional = rest[0], True
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"a repeated option is tuple[X, ...]: {hint!r}")
        return args[0], optional, True
    return hint, optional, False


def _check(cls: type, spec: OptionSpec) -> None:
    where = f"{cls.__name__}.{spec.name}"
    is_enum = isinstance(spec.kind, type) and issubclass(spec.kind, enum.Enum)
    if spec.meta.parse is None and spec.kind not in _SCALARS and not is_enum:
        raise TypeError(f"{where}: give parse= to read a {spec.kind!r} from the command line")
    if spec.kind is bool and (spec.default is not False or spec.repeat):
        raise TypeError(f"{where}: a bool option is a switch, off by default")
    if spec.meta.choices is not None and (is_enum or spec.kind is bool):
        raise TypeError(f"{where}: an Enum's or a switch's choices are its own")
    if spec.repeat and spec.default != () and not spec.meta.required:
        raise TypeError(f"{where}: a repeated option's default is ()")
    if spec.meta.env is not None and spec.repeat:
        raise TypeError(f"{where}: a repeated option is not read from the environment")
    bounds = spec.meta.bounds
    if bounds is not None:
        if spec.kind not in (int, float):
            raise TypeError(f"{where}: bounds are for an int or a float option")
        default = spec.default
        if default not in (None, (), dataclasses.MISSING) and not bounds.admits(default):
            raise TypeError(f"{where}: the default {default!r} is not "
                            f"{bounds.allowed(real=spec.kind is float)}")
