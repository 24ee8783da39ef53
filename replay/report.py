"""The replay report: ``report.md`` with one table per trace, and PNG plots beside it.

Plots (matplotlib, imported only here — the ``replay`` extra; drawn on ``Figure`` objects,
without pyplot's global figure registry or backend): hit rate per policy against the pooled
bounds, TTFT and ITL CDFs, per-worker load over time, and predicted vs actual cached tokens per
request.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from replay.oracle import OracleResult
from replay.summary import PolicySummary, RequestOutcome

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["PolicyResult", "TraceReport", "markdown_table", "write_report"]


@dataclass(slots=True)
class PolicyResult:
    summary: PolicySummary
    outcomes: list[RequestOutcome]
    itl_samples: list[tuple[float, float]] = field(default_factory=list)
    load_times: list[float] = field(default_factory=list)
    load: list[list[int]] = field(default_factory=list)  # in flight per worker per sample
    wall_s: float = 0.0


@dataclass(slots=True)
class TraceReport:
    trace: str
    settings: str  # one line: replicas, capacity, timing...
    policies: list[PolicyResult]
    oracles: list[OracleResult] = field(default_factory=list)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or "trace"


def _fmt(value: float, digits: int = 2) -> str:
    return "—" if not math.isfinite(value) else f"{value:.{digits}f}"


def _pct(value: float) -> str:
    return "—" if not math.isfinite(value) else f"{value:.1%}"


def markdown_table(report: TraceReport) -> str:
    """The per-policy table (plus the bounds) for one trace, in markdown."""
    lines = [
        "| policy | hit rate | TTFT p50 (s) | TTFT p99 (s) | ITL p50 (ms) | ITL p99 (ms) "
        "| e2e p50 (s) | load imbalance | predicted−actual gap | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in report.policies:
        s = p.summary
        lines.append(
            f"| {s.policy} | {s.hit_rate:.1%} | {_fmt(s.ttft_p50)} | {_fmt(s.ttft_p99)} "
            f"| {_fmt(s.itl_p50 * 1e3, 1)} | {_fmt(s.itl_p99 * 1e3, 1)} | {_fmt(s.e2e_p50)} "
            f"| {s.load_imbalance:.2f} | {_pct(s.predicted_gap)} | {s.errors} |"
        )
    lines.extend(
        f"| bound: {o.name} ({o.capacity_blocks:,} blocks) | {o.hit_rate:.1%} | | | | | | | | |"
        for o in report.oracles
    )
    return "\n".join(lines)


def _figure_type() -> type[Figure]:
    """matplotlib's ``Figure`` class, or a ``RuntimeError`` saying how to install it."""
    try:
        from matplotlib import figure  # noqa: PLC0415 (the optional `replay` extra)
    except ImportError as exc:
        raise RuntimeError(
            "the replay report draws with matplotlib: pip install 'kvsidecar[replay]'"
        ) from exc
    return figure.Figure


def _cdf(
    ax: Axes, values: npt.NDArray[np.float64], weights: npt.NDArray[np.float64] | None, label: str
) -> None:
    keep = np.isfinite(values) & (values > 0)
    values = values[keep]
    if not values.size:
        return
    w = np.ones_like(values) if weights is None else weights[keep]
    order = np.argsort(values)
    cum = np.cumsum(w[order])
    ax.plot(values[order], cum / cum[-1], label=label)


def _plot_hit_rates(new_figure: type[Figure], report: TraceReport, path: Path) -> None:
    fig = new_figure(figsize=(7, 4))
    ax = fig.subplots()
    names = [p.summary.policy for p in report.policies]
    rates = [p.summary.hit_rate * 100 for p in report.policies]
    bars = ax.bar(names, rates, color="tab:blue")
    ax.bar_label(bars, fmt="%.1f%%")
    styles = ["--", ":"]
    for o, style in zip(report.oracles, styles * 4, strict=False):
        ax.axhline(o.hit_rate * 100, color="tab:red", linestyle=style, label=f"{o.name} bound")
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_title(f"{report.trace}: hit rate per policy")
    if report.oracles:
        ax.legend(loc="upper right")
    top = max([*rates, *(o.hit_rate * 100 for o in report.oracles), 1.0])
    ax.set_ylim(0, top * 1.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_cdfs(new_figure: type[Figure], report: TraceReport, path: Path) -> None:
    fig = new_figure(figsize=(11, 4))
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for p in report.policies:
        ttft = np.array([o.ttft for o in p.outcomes if o.error is None], dtype=float)
        _cdf(ax1, ttft, None, p.summary.policy)
        if p.itl_samples:
            gaps, weights = (np.array(x, dtype=float) for x in zip(*p.itl_samples, strict=True))
        else:
            gaps = np.array([o.itl_mean for o in p.outcomes], dtype=float)
            weights = np.ones_like(gaps)
        _cdf(ax2, gaps * 1e3, weights, p.summary.policy)
    for ax, title, unit in ((ax1, "TTFT", "s"), (ax2, "inter-token latency", "ms")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{title} ({unit}, log scale)")
        ax.set_ylabel("fraction of requests" if ax is ax1 else "fraction of tokens")
        ax.set_title(f"{report.trace}: {title} CDF")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_load(new_figure: type[Figure], report: TraceReport, path: Path) -> None:
    shown = [p for p in report.policies if p.load]
    if not shown:
        return
    cols = min(3, len(shown))
    rows = math.ceil(len(shown) / cols)
    fig = new_figure(figsize=(5 * cols, 3.2 * rows))
    axes: list[Axes] = list(fig.subplots(rows, cols, squeeze=False, sharey=True).flat)
    for ax, p in zip(axes, shown, strict=False):
        times = np.array(p.load_times, dtype=float)
        load = np.array(p.load, dtype=float)
        span = max(times[-1] - times[0], 1e-9)
        bins = np.linspace(times[0], times[0] + span, min(60, len(times)) + 1)
        which = np.clip(np.digitize(times, bins) - 1, 0, len(bins) - 2)
        counts = np.bincount(which, minlength=len(bins) - 1)
        centers = (bins[:-1] + bins[1:]) / 2 / 60
        for w in range(load.shape[1]):
            sums = np.bincount(which, weights=load[:, w], minlength=len(bins) - 1)
            mean = np.divide(sums, counts, out=np.full_like(sums, np.nan), where=counts > 0)
            ax.plot(centers, mean, linewidth=1)
        ax.set_title(f"{p.summary.policy} (imbalance {p.summary.load_imbalance:.2f})")
        ax.set_xlabel("trace time (min)")
        ax.set_ylabel("requests in flight per worker")
        ax.grid(True, alpha=0.3)
    for ax in axes[len(shown) :]:
        ax.set_visible(False)
    fig.suptitle(f"{report.trace}: per-worker load over time (one line per worker)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_predicted(new_figure: type[Figure], report: TraceReport, path: Path) -> None:
    shown = [p for p in report.policies if math.isfinite(p.summary.predicted_gap)]
    if not shown:
        return
    fig = new_figure(figsize=(5 * len(shown), 4.2))
    axes: list[Axes] = list(fig.subplots(1, len(shown), squeeze=False).flat)
    for ax, p in zip(axes, shown, strict=True):
        ok = [o for o in p.outcomes if o.error is None]
        pred = np.array([o.predicted_tokens for o in ok], dtype=float) / 1e3
        act = np.array([o.cached_tokens for o in ok], dtype=float) / 1e3
        ax.scatter(pred, act, s=4, alpha=0.3)
        top = max(float(pred.max(initial=0)), float(act.max(initial=0)), 1.0)
        ax.plot([0, top], [0, top], color="tab:red", linewidth=1, label="predicted = actual")
        exact = float(np.mean(pred == act)) if ok else 0.0
        ax.set_title(f"{p.summary.policy}: {exact:.0%} exact, gap {p.summary.predicted_gap:.1%}")
        ax.set_xlabel("predicted cached tokens (thousands)")
        ax.set_ylabel("actual cached tokens (thousands)")
        ax.legend(loc="upper left")
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{report.trace}: the router's prediction vs what the engine found")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(reports: Sequence[TraceReport], out_dir: str | Path, title: str) -> Path:
    """Write ``report.md`` and the PNGs under ``out_dir``; returns the markdown's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    new_figure = _figure_type()
    lines = [f"# {title}", ""]
    for report in reports:
        slug = _slug(report.trace)
        figures = {
            "hit rate per policy": f"{slug}-hit-rate.png",
            "TTFT and ITL CDFs": f"{slug}-latency-cdf.png",
            "per-worker load over time": f"{slug}-load.png",
            "predicted vs actual cached tokens": f"{slug}-predicted.png",
        }
        _plot_hit_rates(new_figure, report, out / figures["hit rate per policy"])
        _plot_cdfs(new_figure, report, out / figures["TTFT and ITL CDFs"])
        _plot_load(new_figure, report, out / figures["per-worker load over time"])
        _plot_predicted(new_figure, report, out / figures["predicted vs actual cached tokens"])
        lines += [f"## {report.trace}", "", report.settings, "", markdown_table(report), ""]
        if report.oracles:
            lines += [
                "Bounds: one cache holding every replica's capacity, walked in arrival order. "
                "pooled-lru is perfect routing with the engines' LRU eviction; pooled-belady "
                "adds perfect (clairvoyant) eviction — the best hit rate achievable with the "
                "same total capacity, the oracle the kv target is measured against.",
                "",
            ]
        lines += [
            f"![{caption}]({name})" for caption, name in figures.items() if (out / name).exists()
        ]
        lines.append("")
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
