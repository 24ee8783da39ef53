"""The bench kit: the report format, the ``--json FILE`` flag, progress lines, tables and
the reading of a streamed reply that every ``scripts/bench_*.py`` shares.

A benchmark reports *figures*, what it measured, named with their units (``ttft_p99_s``,
``blocks_per_s``), and *ratios*, each setting one of them against a baseline measured in the
same run. A ratio is always named ``<figure>_vs_<baseline>`` and oriented so that >= 1 means
as good as the baseline or better: :meth:`Report.ratio` takes both values and which way is
better and divides itself, so no script can get a ratio backwards. ``--json FILE`` writes
exactly ``{"figures": {...}, "ratios": {...}}``: these files are compared across sessions and
their names are cited in ``docs/bench/``.

Importing this module puts the checkout it belongs to first on ``sys.path``. A script run as
``python scripts/bench_x.py`` has only ``scripts/`` there, so it would import our packages
from wherever the venv's editable install points, which can be another checkout (a
worktree's benchmark would then measure the main tree's code). Import it before any package
of ours; ``tests/unit/test_benchkit.py`` checks that every script does.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import aiohttp

ROOT = Path(__file__).resolve().parent.parent
if sys.path[:1] != [str(ROOT)]:
    sys.path.insert(0, str(ROOT))

__all__ = [
    "ROOT",
    "Better",
    "Report",
    "ReportError",
    "StreamedReply",
    "add_json_flag",
    "format_value",
    "print_table",
    "print_values",
    "progress",
    "ratio_se",
    "run_spread",
    "stream_reply",
]

Better = Literal["higher", "lower"]

# Figure names as the scripts have always written them: snake_case with units, a mode before
# a dot (``pinned.mixed_events_per_s``), sizes (``256KiB``), policies (``round-robin``).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*\Z")
_VS = "_vs_"


class ReportError(ValueError):
    """A figure or ratio the report format does not allow; the message says which and why."""


def _check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ReportError(f"{kind} name {name!r}: expected letters, digits, '_', '.' or '-', "
                          "starting with a letter or digit")


def _check_value(what: str, value: float) -> float:
    """``value`` as a plain int or float; ReportError if it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ReportError(f"{what}: expected a number, got {value!r} ({type(value).__name__})")
    if isinstance(value, int):
        return value
    if not math.isfinite(value):
        raise ReportError(f"{what} is {value}: JSON cannot hold it and no session can compare "
                          "it; leave the figure out where nothing was measured")
    return float(value)  # a numpy float64 becomes a plain float


class Report:
    """One run's figures and ratios, checked as they are added."""

    def __init__(self) -> None:
        self._figures: dict[str, float] = {}
        self._ratios: dict[str, float] = {}

    @property
    def figures(self) -> Mapping[str, float]:
        """The figures, in the order they were added (read-only)."""
        return MappingProxyType(self._figures)

    @property
    def ratios(self) -> Mapping[str, float]:
        """The ratios, in the order they were added (read-only)."""
        return MappingProxyType(self._ratios)

    def figure(self, name: str, value: float) -> float:
        """Add the figure ``name``; ``value`` back. A figure may be negative (a growth) but
        must be finite, and is added once."""
        _check_name("figure", name)
        value = _check_value(f"figure {name}", value)
        if name in self._figures:
            raise ReportError(f"figure {name} added twice ({self._figures[name]!r}, {value!r})")
        self._figures[name] = value
        return value

    def add_figures(self, values: Mapping[str, float], *, prefix: str = "") -> None:
        """Add every figure of ``values``, each name after ``prefix``."""
        for name, value in values.items():
            self.figure(prefix + name, value)

    def ratio(self, figure: str, baseline: str, ours: float, theirs: float, *,
              better: Better, ndigits: int | None = None) -> float:
        """Add the ratio ``<figure>_vs_<baseline>`` of ``ours`` against the baseline's
        ``theirs`` and return it: ours / theirs where a higher figure is better (a rate),
        theirs / ours where a lower one is (a latency, a size), so that >= 1 always means
        as good as the baseline or better. ``ndigits`` rounds it, as ``round`` does."""
        for kind, part in (("figure", figure), ("baseline", baseline)):
            _check_name(f"ratio's {kind}", part)
            if _VS in part:
                raise ReportError(f"ratio's {kind} {part!r} contains {_VS!r}: a ratio's name "
                                  "is <figure>_vs_<baseline>, one of each")
        name = f"{figure}{_VS}{baseline}"
        if better not in ("higher", "lower"):
            raise ReportError(f"ratio {name}: better={better!r}, expected 'higher' or 'lower'")
        ours = _check_value(f"ratio {name}: ours", ours)
        theirs = _check_value(f"ratio {name}: theirs", theirs)
        if ours < 0 or theirs < 0:
            raise ReportError(f"ratio {name}: ours={ours!r}, theirs={theirs!r}; a ratio "
                              "compares quantities >= 0")
        top, bottom, which = ((ours, theirs, "theirs (the baseline)") if better == "higher"
                              else (theirs, ours, "ours (lower is better)"))
        if bottom == 0:
            raise ReportError(f"ratio {name}: {which} is 0, so the ratio has no value; "
                              "leave it out for this run")
        value = top / bottom
        if ndigits is not None:
            value = round(value, ndigits)
        if name in self._ratios:
            raise ReportError(f"ratio {name} added twice ({self._ratios[name]!r}, {value!r})")
        self._ratios[name] = _check_value(f"ratio {name}", value)
        return value

    def include(self, other: Report, *, prefix: str) -> None:
        """Add ``other``'s figures and ratios (already checked), each name after
        ``prefix``: one report per pass or mode, as ``pinned.`` and ``unpinned.``."""
        self.add_figures(other.figures, prefix=prefix)
        for name, value in other.ratios.items():
            _check_name("ratio", prefix + name)
            if prefix + name in self._ratios:
                raise ReportError(f"ratio {prefix + name} added twice")
            self._ratios[prefix + name] = value

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{"figures": {...}, "ratios": {...}}``: the report format, and nothing else."""
        return {"figures": dict(self._figures), "ratios": dict(self._ratios)}

    def write_json(self, path: str | Path) -> None:
        """Write :meth:`as_dict` to ``path`` as JSON and say so on stderr."""
        Path(path).write_text(json.dumps(self.as_dict(), indent=2, allow_nan=False) + "\n")
        progress(f"wrote {path}")

    def print_figures(self, title: str = "figures") -> None:
        """Every figure, one a line."""
        print_values(title, self._figures)

    def print_ratios(self, subject: str = "ours",
                     notes: Mapping[str, str] | None = None) -> None:
        """Every ratio, one a line, under a heading that says how to read them; ``notes``:
        text after a ratio's value (a target), by ratio name."""
        print_values(f"ratios (>= 1: {subject} as good as the baseline or better)",
                     self._ratios, digits=3, notes=notes)


def run_spread(runs: Sequence[float], pooled: float) -> float:
    """How far single runs of one configuration spread around their pooled figure: the
    standard deviation of ``runs`` relative to ``pooled`` (0 with fewer than two runs or a
    pooled 0). Timing alone moves a run's figures by a few percent (docs/bench/replicas.md),
    so a difference between two configurations means something only beyond this."""
    if len(runs) < 2 or not pooled:
        return 0.0
    return statistics.stdev(runs) / abs(pooled)


def ratio_se(ratio: float, ours_spread: float, theirs_spread: float, runs: int) -> float:
    """The standard error of ``ratio``, ours over theirs, each pooled over ``runs`` runs
    whose relative spreads (:func:`run_spread`) are given: relative errors of a quotient add
    in quadrature, and pooling ``runs`` runs divides each by sqrt(runs)."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    return abs(ratio) * math.hypot(ours_spread, theirs_spread) / math.sqrt(runs)


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """``--json FILE``: where :meth:`Report.write_json` writes (``args.json``, a Path)."""
    parser.add_argument("--json", type=Path, metavar="FILE",
                        help='write {"figures": {...}, "ratios": {...}} to FILE')


def progress(msg: str) -> None:
    """A progress line on stderr: ``[bench_x HH:MM:SS] msg`` (stdout keeps the results)."""
    print(f"[{Path(sys.argv[0]).stem} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr,
          flush=True)


def format_value(value: float, digits: int | None = None) -> str:
    """A number for a table: ints with thousands separators; floats with ``digits`` decimals,
    or by default about four significant digits without an exponent for 1 and over."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if digits is not None:
        return f"{value:,.{digits}f}"
    if not math.isfinite(value):
        return str(value)
    size = abs(value)
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 1:
        return f"{value:.{4 - len(str(int(size)))}f}"
    return f"{value:.4g}"


def print_values(title: str, values: Mapping[str, float], *, digits: int | None = None,
                 notes: Mapping[str, str] | None = None) -> None:
    """``title``, then one ``name  value`` line per entry, names and values aligned."""
    print(f"\n{title}:")
    if not values:
        print("  (none)")
        return
    width = max(map(len, values))
    cells = {name: format_value(value, digits) for name, value in values.items()}
    value_width = max(map(len, cells.values()))
    for name, cell in cells.items():
        note = (notes or {}).get(name)
        print(f"  {name:<{width}}  {cell:>{value_width}}" + (f"  {note}" if note else ""))


def print_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    """A table with a header line: the first column left-aligned, the others right-aligned;
    numbers through :func:`format_value`, anything else as ``str``, None as ``-``."""
    text = [list(header)] + [
        ["-" if c is None else format_value(c) if isinstance(c, int | float) else str(c)
         for c in row] for row in rows]
    widths = [max(len(r[i]) for r in text if i < len(r)) for i in range(len(header))]
    for r in text:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths, strict=False))).rstrip())


@dataclass
class StreamedReply:
    """One streamed reply as a client saw it, timed from just before its request was sent."""

    status: int
    headers: Mapping[str, str]
    ttft_s: float | None = None  # to the first data event; None: there was none
    itl_s: list[float] = field(default_factory=list)  # between consecutive data events
    text: str = ""  # the choices' content (chat deltas) or text (completions), joined
    usage: dict[str, Any] | None = None  # the last usage a chunk carried
    error: str = ""  # a reply other than 200: its body, for a message saying why


async def stream_reply(session: aiohttp.ClientSession, url: str, body: Mapping[str, Any], *,
                       headers: Mapping[str, str] | None = None) -> StreamedReply:
    """POST ``body`` (with ``"stream": true``) to ``url`` and read its server-sent events to
    the end: TTFT, inter-token latencies, the text and the usage. A reply other than 200 is
    read whole and returned with its status and its body (``error``) alone."""
    t0 = time.perf_counter()
    async with session.post(url, json=body, headers=headers) as resp:
        reply = StreamedReply(resp.status, resp.headers)
        if resp.status != 200:
            reply.error = (await resp.read()).decode(errors="replace")
            return reply
        last = t0
        parts: list[str] = []
        async for line in resp.content:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            now = time.perf_counter()
            if reply.ttft_s is None:
                reply.ttft_s = now - t0
            else:
                reply.itl_s.append(now - last)
            last = now
            chunk = json.loads(line[5:])
            reply.usage = chunk.get("usage") or reply.usage
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                parts.append(delta.get("content") or choice.get("text") or "")
        reply.text = "".join(parts)
    return reply
