"""``kvsidecar replay``: replay request traces live against a gateway, or offline through a
simulated fleet, and write a report.

Examples::

    kvsidecar replay conversation_trace.jsonl --offline --replicas 8 \\
        --capacity-tokens 2340000 --policy all --report out/
    kvsidecar replay conversation_trace.jsonl --url http://127.0.0.1:8000 --limit 200 \\
        --speedup 10 --output replay.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from refengine.timing import TimingModel
from replay.live import main_live
from replay.offline import FleetConfig, Policy, outcomes, simulate
from replay.oracle import pooled_belady, pooled_lru
from replay.report import PolicyResult, TraceReport, markdown_table, write_report
from replay.summary import summarize
from replay.traces import TRACE_BLOCK_TOKENS, TraceError, TraceRecord, load_for_replay
from routing.placement.scorer import ScoringWeights

__all__ = ["build_parser", "main", "run_offline"]

_POLICY_CHOICES = [p.value for p in Policy] + ["oracle", "all"]


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default only when there is one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action) or text


def build_parser() -> argparse.ArgumentParser:
    _t = TimingModel()
    p = argparse.ArgumentParser(
        prog="kvsidecar replay",
        description="Replay request traces (Mooncake JSONL with prefix hash ids, or Azure CSV): "
        "live against a gateway (--url), or offline through a discrete-event model of N "
        "reference-engine replicas placed by the real routing core (--offline).",
        formatter_class=_Help,
    )
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace file(s): .jsonl or .csv")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--offline", action="store_true", help="simulate instead of sending")
    mode.add_argument("--url", help="the gateway's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--limit", type=int, help="replay only the first N requests of each trace")
    p.add_argument(
        "--speedup", type=float, default=1.0, help="compress arrival times by this factor"
    )
    p.add_argument(
        "--prefix-share",
        type=float,
        default=0.0,
        help="for traces without prefix ids (Azure): share of each prompt taken "
        "from one of a few shared prefixes",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for random choices")
    p.add_argument("--report", metavar="DIR", help="write report.md and PNG plots here")
    p.add_argument("--quiet", action="store_true", help="no progress line on stderr")

    o = p.add_argument_group("offline fleet (--offline)")
    o.add_argument("--replicas", type=int, default=8, help="simulated engine replicas")
    o.add_argument(
        "--capacity-tokens",
        type=int,
        help="KV cache per replica, in tokens (the engines' --max-total-tokens)",
    )
    o.add_argument(
        "--capacity-share",
        type=float,
        help="instead of --capacity-tokens: all replicas together hold this share "
        "of the trace's distinct blocks",
    )
    o.add_argument(
        "--policy",
        action="append",
        choices=_POLICY_CHOICES,
        help="placement policy to simulate (repeatable); oracle = the pooled "
        "LRU and Belady bounds; all (the default) = every policy and the bounds",
    )
    o.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    o.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=512,
        help="prompt tokens computed per prefill step (the engine's flag)",
    )
    o.add_argument(
        "--max-running-requests",
        type=int,
        default=64,
        help="requests admitted at once per replica (the engine's flag)",
    )
    o.add_argument(
        "--overlap-weight", type=float, default=1.0, help="the router's credit per cached block"
    )
    o.add_argument(
        "--prefill-load-scale",
        type=float,
        default=1.0,
        help="the router's weight of prefill work against decode blocks (gateway flag of the "
        "same name)",
    )
    o.add_argument(
        "--router-temperature",
        type=float,
        default=0.0,
        help="0 picks the cheapest worker; > 0 samples ∝ exp(−cost/T)",
    )
    o.add_argument(
        "--approx-ttl-s",
        type=float,
        default=120.0,
        help="how long a routed prefix counts as cached without an event",
    )
    o.add_argument(
        "--event-delay-ms", type=float, default=0.0, help="KV event latency from replica to router"
    )
    o.add_argument(
        "--sim-prefill-base-ms",
        type=float,
        default=_t.prefill_base_s * 1e3,
        help="timing model (the engine's --compute sim flags): per prefill step",
    )
    o.add_argument(
        "--sim-prefill-us-per-token",
        type=float,
        default=_t.prefill_per_token_s * 1e6,
        help="per uncached prompt token",
    )
    o.add_argument(
        "--sim-decode-base-ms", type=float, default=_t.decode_base_s * 1e3, help="per decode step"
    )
    o.add_argument(
        "--sim-decode-us-per-seq",
        type=float,
        default=_t.decode_per_seq_s * 1e6,
        help="per sequence in a decode step",
    )

    live = p.add_argument_group("live replay (--url)")
    live.add_argument(
        "--output", help="JSONL file, one record per request (default: replay-<trace>.jsonl)"
    )
    live.add_argument(
        "--max-concurrency",
        type=int,
        default=64,
        help="requests in flight at most (later ones wait)",
    )
    live.add_argument("--model", help="the model field of each request (default: the first "
                      "model the gateway lists at /v1/models)")
    live.add_argument("--model-path", help="model directory whose config.json gives vocab_size")
    live.add_argument(
        "--vocab-size",
        type=int,
        default=1024,
        help="token ids are synthesized below this (unless --model-path)",
    )
    live.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="the gateway's block size: converts x-kvsidecar-cached-blocks",
    )
    live.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="longest silence on a request's stream before it is failed",
    )
    return p


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


def _capacity(args: argparse.Namespace, records: Sequence[TraceRecord]) -> int:
    if args.capacity_tokens is not None:
        return int(args.capacity_tokens)
    if args.capacity_share is None:
        raise ValueError("--offline needs --capacity-tokens or --capacity-share")
    if not 0 < args.capacity_share <= 1:
        raise ValueError(f"--capacity-share must be in (0, 1], got {args.capacity_share}")
    distinct = len({h for r in records for h in r.hash_ids})
    per_replica = args.capacity_share * distinct * TRACE_BLOCK_TOKENS / args.replicas
    return max(TRACE_BLOCK_TOKENS, int(per_replica) // TRACE_BLOCK_TOKENS * TRACE_BLOCK_TOKENS)


def fleet_config(args: argparse.Namespace, capacity_tokens: int) -> FleetConfig:
    return FleetConfig(
        replicas=args.replicas,
        capacity_tokens=capacity_tokens,
        timing=TimingModel(
            prefill_base_s=args.sim_prefill_base_ms / 1e3,
            prefill_per_token_s=args.sim_prefill_us_per_token / 1e6,
            decode_base_s=args.sim_decode_base_ms / 1e3,
            decode_per_seq_s=args.sim_decode_us_per_seq / 1e6,
        ),
        page_size=args.page_size,
        chunk_size=args.chunked_prefill_size,
        max_running=args.max_running_requests,
        weights=ScoringWeights(
            overlap_weight=args.overlap_weight,
            prefill_load_scale=args.prefill_load_scale,
            temperature=args.router_temperature,
        ),
        approx_ttl_s=args.approx_ttl_s,
        event_delay_s=args.event_delay_ms / 1e3,
        speedup=args.speedup,
        seed=args.seed,
    )


def run_offline(
    name: str,
    records: Sequence[TraceRecord],
    cfg: FleetConfig,
    policies: Sequence[Policy],
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
                    predicts=policy in (Policy.KV, Policy.APPROX),
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


def _policies(chosen: list[str] | None) -> tuple[list[Policy], bool]:
    chosen = chosen or ["all"]
    if "all" in chosen:
        return list(Policy), True
    return [Policy(c) for c in chosen if c != "oracle"], "oracle" in chosen


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        if args.offline:
            return _main_offline(args)
        return asyncio.run(main_live(args))
    except (TraceError, ValueError) as exc:
        print(f"kvsidecar replay: {exc}", file=sys.stderr)
        return 2


def _main_offline(args: argparse.Namespace) -> int:
    policies, bounds = _policies(args.policy)
    reports = []
    for path in args.traces:
        records = load_for_replay(path, args.limit, args.prefix_share, args.seed)
        cfg = fleet_config(args, _capacity(args, records))
        report = run_offline(Path(path).name, records, cfg, policies, bounds, args.quiet)
        reports.append(report)
        print(f"## {report.trace}\n\n{report.settings}\n\n{markdown_table(report)}\n")
    if args.report:
        written = write_report(reports, args.report, "Offline trace replay")
        print(f"report written to {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
