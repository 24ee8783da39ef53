"""The range an option's number may take, declared once with the option
(``option(..., ge=0, le=65535)``: pydantic's ``Field`` spelling, ``ge``/``gt`` below and
``le``/``lt`` above) and checked wherever a config is made: a flag, a ``--config`` file's key
and the dataclass built in code (``kvcore.options``). One rule, so one wording: "must be in
[0, 65535], got 70000"."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Bounds"]


@dataclass(frozen=True, slots=True)
class Bounds:
    """At least ``ge`` or more than ``gt``; at most ``le`` or less than ``lt`` (None: open).
    A float must be finite as well: a timeout of inf or nan is no timeout anyone meant."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def __post_init__(self) -> None:
        if self.ge is not None and self.gt is not None:
            raise TypeError("a lower bound is ge= or gt=, not both")
        if self.le is not None and self.lt is not None:
            raise TypeError("an upper bound is le= or lt=, not both")
        low, high = self.low, self.high
        if low is None and high is None:
            raise TypeError("bounds are ge=, gt=, le= or lt=; none was given")
        if low is not None and high is not None and low > high:
            raise TypeError(f"no number is {self.allowed(real=False)}")

    @property
    def low(self) -> float | None:
        return self.ge if self.ge is not None else self.gt

    @property
    def high(self) -> float | None:
        return self.le if self.le is not None else self.lt

    def admits(self, value: object) -> bool:
        """Whether ``value`` is a number within the bounds (a bool is no number here)."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def allowed(self, *, real: bool) -> str:
        """What is allowed, in words: "in [1, 4096]", "in (0, 1]", ">= 1", and for a float
        (``real``) open on one side "a finite number > 0"."""
        low, high = self.low, self.high
        if low is not None and high is not None:
            return (f"in {'[' if self.ge is not None else '('}{_number(low)}, "
                    f"{_number(high)}{']' if self.le is not None else ')'}")
        finite = "a finite number " if real else ""
        if low is not None:
            return f"{finite}{'>=' if self.ge is not None else '>'} {_number(low)}"
        if high is not None:
            return f"{finite}{'<=' if self.le is not None else '<'} {_number(high)}"
        raise AssertionError("bounds without a side")  # refused in __post_init__

    def check(self, value: object, *, real: bool) -> None:
        """``ValueError`` "must be <allowed>, got <value>" unless the bounds admit ``value``;
        the caller names the option (flag, file key or field) in front."""
        if not self.admits(value):
            raise ValueError(f"must be {self.allowed(real=real)}, got {value!r}")


def _number(bound: float) -> str:
    """A bound as its reader writes it: 0 rather than 0.0."""
    if isinstance(bound, float) and bound.is_integer():
        return str(int(bound))
    return str(bound)
