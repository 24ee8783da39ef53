"""``kvsidecar replay``: replay request traces live against a gateway, or offline through a
simulated fleet, and write a report.

Examples::

    kvsidecar replay conversation_trace.jsonl --offline --replicas 8 \\
        --capacity-tokens 2340000 --policy all --report out/
    kvsidecar replay conversation_trace.jsonl --url http://127.0.0.1:8000 --limit 200 \\
        --speedup 10 --output replay.jsonl
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from replay.config import ReplayConfig
from replay.live import main_live
from replay.offline import FleetConfig, outcomes, simulate
from replay.oracle import pooled_belady, pooled_lru
from replay.report import PolicyResult, TraceReport, markdown_table, write_report
from replay.summary import summarize
from replay.traces import TRACE_BLOCK_TOKENS, TraceError, TraceRecord, load_for_replay
from routing.config import RouterMode

__all__ = ["main", "run_offline"]

class _Progress:
    """One updating stderr line."""

    def __init__(self, label: str, quiet: bool) -> None:
        self.label = label
        self.quiet = quiet or not sys.stderr.isatty()
        self._t0 = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if self.quiet:
            return
        rate = done / max(time.monotonic() - self._t0, 1e-9)
        sys.stderr.write(f"\r{self.label}: {done}/{total} requests ({rate:,.0f}/s)   ")
        sys.stderr.flush()

    def close(self) -> None:
        if not self.quiet:
            sys.stderr.write("\n")


def run_offline(
    name: str,
    records: Sequence[TraceRecord],
    cfg: FleetConfig,
    policies: Sequence[RouterMode],
    bounds: bool,
    quiet: bool = True,
) -> TraceReport:
    """Simulate each policy (and the pooled bounds) on one trace."""
    results = []
    for policy in policies:
        progress = _Progress(f"{name} {policy.value}", quiet)
        t0 = time.perf_counter()
        run = simulate(records, policy, cfg, progress)
        wall = time.perf_counter() - t0
        progress.close()
        outs = outcomes(run)
        results.append(
            PolicyResult(
                summarize(
                    policy.value,
                    outs,
                    run.itl_samples,
                    predicts=policy in (RouterMode.KV, RouterMode.APPROX),
                ),
                outs,
                run.itl_samples,
                run.load_times,
                run.load,
                wall,
            )
        )
    oracles = []
    if bounds:
        capacity_blocks = max(1, cfg.capacity_tokens * cfg.replicas // TRACE_BLOCK_TOKENS)
        oracles = [pooled_lru(records, capacity_blocks), pooled_belady(records, capacity_blocks)]
    t = cfg.timing
    settings = (
        f"{len(records):,} requests, {cfg.replicas} replicas × {cfg.capacity_tokens:,} KV tokens "
        f"(page {cfg.page_size}, chunked prefill {cfg.chunk_size}, max running "
        f"{cfg.max_running}); timing: prefill {t.prefill_per_token_s * 1e6:g} µs/token + "
        f"{t.prefill_base_s * 1e3:g} ms/step, decode {t.decode_base_s * 1e3:g} ms + "
        f"{t.decode_per_seq_s * 1e6:g} µs/seq; router: overlap weight "
        f"{cfg.weights.overlap_weight:g}, prefill load scale "
        f"{cfg.weights.prefill_load_scale:g}, temperature {cfg.weights.temperature:g}, "
        f"speculative TTL {cfg.approx_ttl_s:g} s; arrivals ×{cfg.speedup:g}."
    )
    return TraceReport(name, settings, results, oracles)


def main(argv: list[str] | None = None) -> int:
    cfg = ReplayConfig.from_args(argv)  # a bad flag or config: argparse's error, exit 2
    try:
        if cfg.offline:
            return _main_offline(cfg)
        return asyncio.run(main_live(cfg))
    except (TraceError, ValueError) as exc:
        print(f"kvsidecar replay: {exc}", file=sys.stderr)
        return 2


def _main_offline(cfg: ReplayConfig) -> int:
    policies, bounds = cfg.chosen_policies
    reports = []
    for path in cfg.traces:
        records = load_for_replay(path, cfg.limit, cfg.prefix_share, cfg.seed)
        distinct = len({h for r in records for h in r.hash_ids})
        fleet = cfg.fleet(cfg.capacity(distinct, TRACE_BLOCK_TOKENS))
        report = run_offline(Path(path).name, records, fleet, policies, bounds, cfg.quiet)
        reports.append(report)
        print(f"## {report.trace}\n\n{report.settings}\n\n{markdown_table(report)}\n")
    if cfg.report:
        written = write_report(reports, cfg.report, "Offline trace replay")
        print(f"report written to {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
