#!/usr/bin/env python3
"""Aggregated vs disaggregated serving on the local stack, with simulated engines.

Each run is the stack of ``kvsidecar up --compute sim``, started through its launcher
``kvsidecar.local_stack`` (the reference engine's timing model: a prefill step delays every
decode step of its replica, the interference disaggregation removes), driven through the
gateway with a mixed workload:

* *decoders*: ``--decoders`` clients, each sending one streaming request after another
  (a ``--short-prompt``-token prompt, ``--decode-tokens`` generated);
* *long prompts*: a ``--long-prompt``-token prompt (``--long-tokens`` generated) arriving
  every ``--long-interval-ms``, while the decoders decode.

Prompts are fresh random token ids (no prefix reuse). Measured at the client, after a
warm-up: TTFT p50/p99 of both classes and ITL p50/p99 (gaps between a decoder's streamed
tokens). Scenarios, each aggregated vs disaggregated at the same total replica count:

* ``mixed``: the workload above on 4 replicas (4 agg | 2 prefill + 2 decode);
* ``short``: decoders only (no long prompts) on 4 replicas;
* ``small``: the mixed workload at half the rate on 2 replicas (2 agg | 1 prefill + 1 decode);
* ``slow``: ``mixed`` disaggregated with a KV handoff that costs ``--slow-ms-per-1k`` ms per
  1,000 prompt tokens (a slow cross-host link), against the ``mixed`` aggregated run;
* ``early``: ``mixed`` disaggregated with ``--kv-load-failure-policy fail``, where the first
  token streams as soon as the prefill has it instead of after the handoff (no fallback
  possible), against the ``mixed`` aggregated run.

Ratios ``<figure>_disagg_vs_agg`` are agg / disagg: >= 1 means disaggregation is as good or
better. It also times moving 1,000 tokens of KV between two block stores through the decode
sidecar's ``TransferServiceHandoff`` (``sidecar/transfer``: shm, tcp, and nixl when installed)
for the shipped tiny model and a Llama-3-8B-class layout, against a plain memcpy of the same
bytes (``transfer_<layout>_<transport>_vs_memcpy`` = memcpy / transport time).

    scripts/bench_disagg.py [--duration-s 6] [--scenarios early mixed]
        [--gateway-arg=--decode-interference-weight=0] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from benchkit import Report, add_json_flag, progress

from kvcore.logs import configure_logging
from kvsidecar.local_stack import EngineSpec, GatewaySpec, LocalStack, StackSpec

VOCAB = (10, 1000)  # the tiny model has 1,024 token ids
SCENARIOS = ("mixed", "short", "small", "slow", "early")


@dataclass
class Samples:
    ttft_short: list[float] = field(default_factory=list)
    ttft_long: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: int = 0
    requests: int = 0
    first_error: str = ""


@dataclass(frozen=True)
class Run:
    scenario: str
    mode: str  # agg | disagg
    replicas: int
    long_interval_ms: float | None  # None: no long prompts
    decoders: int
    handoff_ms_per_1k: float = 0.0
    policy: str = "fallback"  # fail: the decode sidecar streams the first token at once


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _failed(samples: Samples, measure: bool, why: str) -> None:
    samples.errors += measure
    samples.first_error = samples.first_error or why


async def _one(session: aiohttp.ClientSession, url: str, prompt: list[int], out: int,
               samples: Samples, long: bool, measure: bool) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": out, "stream": True,
            "ignore_eos": True, "temperature": 0}
    started = time.perf_counter()
    stamps: list[float] = []
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                _failed(samples, measure, f"{resp.status} {(await resp.read())[:200]!r}")
                return
            stamps.extend([
                time.perf_counter() async for line in resp.content
                if line.startswith(b"data:") and not line.startswith(b"data: [DONE]")
            ])
    except aiohttp.ClientError as exc:
        _failed(samples, measure, repr(exc))
        return
    if not measure or not stamps:
        return
    samples.requests += 1
    ttft = stamps[0] - started
    (samples.ttft_long if long else samples.ttft_short).append(ttft)
    if not long:
        samples.itl.extend(b - a for a, b in itertools.pairwise(stamps))


async def _workload(url: str, run: Run, args: argparse.Namespace) -> Samples:
    samples = Samples()
    rng = random.Random(7)
    loop = asyncio.get_running_loop()
    start = loop.time()
    warm_end = start + args.warmup_s
    end = warm_end + args.duration_s

    def prompt(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def decoder() -> None:
            while loop.time() < end:
                measure = loop.time() >= warm_end
                await _one(session, url, prompt(args.short_prompt), args.decode_tokens,
                           samples, False, measure)

        async def long_arrivals() -> None:
            tasks = []
            assert run.long_interval_ms is not None
            while loop.time() < end:
                measure = loop.time() >= warm_end
                tasks.append(asyncio.create_task(_one(
                    session, url, prompt(args.long_prompt), args.long_tokens, samples, True,
                    measure)))
                await asyncio.sleep(run.long_interval_ms / 1e3)
            await asyncio.gather(*tasks)

        jobs = [decoder() for _ in range(run.decoders)]
        if run.long_interval_ms is not None:
            jobs.append(long_arrivals())
        await asyncio.gather(*jobs)
    return samples


def _spec(run: Run, args: argparse.Namespace) -> StackSpec:
    """What ``kvsidecar up --compute sim`` would run for ``run``."""
    if run.mode == "agg":
        engines = (EngineSpec(replicas=run.replicas),)
    else:
        half = run.replicas // 2
        engines = (EngineSpec(replicas=half, role="prefill"),
                   EngineSpec(replicas=run.replicas - half, role="decode"))
    return StackSpec(engines=engines,
                     gateways=(GatewaySpec(kv_load_failure_policy=run.policy,
                                           args=tuple(args.gateway_arg)),),
                     max_total_tokens=65536, speedup=args.speedup,
                     handoff_ms_per_1k_tokens=0.0 if run.mode == "agg" else run.handoff_ms_per_1k)


async def _measure(run: Run, args: argparse.Namespace, workdir: Path) -> Samples:
    stack_dir = workdir / f"{run.scenario}-{run.mode}" / "stack"
    async with LocalStack(_spec(run, args), stack_dir) as stack:
        return await _workload(stack.url, run, args)


def _runs(args: argparse.Namespace) -> list[Run]:
    li = args.long_interval_ms
    runs = [
        Run("mixed", "agg", 4, li, args.decoders),
        Run("mixed", "disagg", 4, li, args.decoders),
        Run("short", "agg", 4, None, args.decoders),
        Run("short", "disagg", 4, None, args.decoders),
        Run("small", "agg", 2, li * 2, max(1, args.decoders // 2)),
        Run("small", "disagg", 2, li * 2, max(1, args.decoders // 2)),
        Run("slow", "disagg", 4, li, args.decoders, args.slow_ms_per_1k),
        Run("early", "disagg", 4, li, args.decoders, policy="fail"),
    ]
    # slow and early are measured against mixed's aggregated run: it comes along with them
    chosen = set(args.scenarios)
    if chosen & {"slow", "early"}:
        return [r for r in runs if r.scenario in chosen or (r.scenario, r.mode) == ("mixed", "agg")]
    return [r for r in runs if r.scenario in chosen]


def _transports() -> list[str]:
    try:
        import nixl  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        progress("nixl: not installed, not measured (pip install 'kvsidecar[nixl]')")
        return ["shm", "tcp"]
    return ["shm", "tcp", "nixl"]


async def _transfer(report: Report, rounds: int) -> None:
    try:  # the transfer service is optional here: report its absence, don't hide it
        from _disagg_transfer import measure_transfer  # scripts/ is on sys.path

        measured = await measure_transfer(_transports(), rounds)
    except Exception as exc:
        progress(f"transfer: not measured ({exc!r})")
        return
    print("\nKV handoff transfer time per 1,000 tokens (median ms; two stores on this host)")
    print(f"{'layout':<8}" + "".join(f"{t:>16}" for t in next(iter(measured.values()))))
    for layout, per in measured.items():
        print(f"{layout:<8}" + "".join(f"{v:>16.2f}" for v in per.values()))
        for transport, ms in per.items():
            figure = f"transfer_{layout}_{transport}"
            report.figure(f"{figure}_ms_per_1k_tokens", round(ms, 3))
            if ms <= 0:  # too fast to time: no ratio
                continue
            if transport.startswith("shm_groups"):
                report.ratio(figure, "one_pull", ms, per["shm"], better="lower", ndigits=3)
            elif transport != "memcpy":
                report.ratio(figure, "memcpy", ms, per["memcpy"], better="lower", ndigits=3)


async def _bench(args: argparse.Namespace) -> Report:
    report = Report()
    with tempfile.TemporaryDirectory(prefix="kvsidecar-bench-disagg-") as tmp:
        results: dict[tuple[str, str], Samples] = {}
        for run in _runs(args):
            progress(f"running {run.scenario}/{run.mode} ({run.replicas} replicas)...")
            results[(run.scenario, run.mode)] = await _measure(run, args, Path(tmp))
    print(f"\n{'scenario':<9}{'mode':<8}{'reqs':>6}{'err':>5}{'TTFT short p50/p99 ms':>24}"
          f"{'TTFT long p50/p99 ms':>23}{'ITL p50/p99 ms':>18}")
    for (scenario, mode), s in results.items():
        row = {
            "ttft_short_p50_ms": _pct(s.ttft_short, 0.5) * 1e3,
            "ttft_short_p99_ms": _pct(s.ttft_short, 0.99) * 1e3,
            "ttft_long_p50_ms": _pct(s.ttft_long, 0.5) * 1e3,
            "ttft_long_p99_ms": _pct(s.ttft_long, 0.99) * 1e3,
            "itl_p50_ms": _pct(s.itl, 0.5) * 1e3,
            "itl_p99_ms": _pct(s.itl, 0.99) * 1e3,
        }
        for name, value in row.items():
            if not math.isnan(value):  # NaN: that class had no request in this scenario
                report.figure(f"{scenario}_{mode}_{name}", round(value, 3))
        report.figure(f"{scenario}_{mode}_requests", s.requests)
        report.figure(f"{scenario}_{mode}_errors", s.errors)
        if s.first_error:
            progress(f"{scenario}/{mode}: first error: {s.first_error}")
        print(f"{scenario:<9}{mode:<8}{s.requests:>6}{s.errors:>5}"
              f"{row['ttft_short_p50_ms']:>12.1f}/{row['ttft_short_p99_ms']:<11.1f}"
              f"{row['ttft_long_p50_ms']:>11.1f}/{row['ttft_long_p99_ms']:<11.1f}"
              f"{row['itl_p50_ms']:>8.1f}/{row['itl_p99_ms']:<9.1f}")
    for scenario in SCENARIOS:
        base = "mixed" if scenario in ("slow", "early") else scenario
        for name in ("itl_p50_ms", "itl_p99_ms", "ttft_short_p50_ms", "ttft_short_p99_ms",
                     "ttft_long_p50_ms", "ttft_long_p99_ms"):
            agg = report.figures.get(f"{base}_agg_{name}")
            dis = report.figures.get(f"{scenario}_disagg_{name}")
            if agg and dis:  # both measured
                report.ratio(f"{scenario}_{name.removesuffix('_ms')}_disagg", "agg", dis, agg,
                             better="lower", ndigits=3)
    await _transfer(report, args.transfer_rounds)
    report.print_ratios("disaggregation, or the transport,")
    return report


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=6.0, help="measured seconds per run")
    p.add_argument("--warmup-s", type=float, default=1.0, help="unmeasured seconds first")
    p.add_argument("--decoders", type=int, default=8, help="decoding clients (4-replica runs)")
    p.add_argument("--short-prompt", type=int, default=256, help="decoders' prompt tokens")
    p.add_argument("--decode-tokens", type=int, default=64, help="decoders' output tokens")
    p.add_argument("--long-prompt", type=int, default=4096, help="long prompts' tokens")
    p.add_argument("--long-tokens", type=int, default=4, help="long prompts' output tokens")
    p.add_argument("--long-interval-ms", type=float, default=250.0,
                   help="a long prompt arrives this often (4-replica runs)")
    p.add_argument("--slow-ms-per-1k", type=float, default=200.0,
                   help="the slow scenario's handoff cost per 1,000 prompt tokens")
    p.add_argument("--speedup", type=float, default=1.0, help="sim engines' speedup")
    p.add_argument("--transfer-rounds", type=int, default=5, help="measured pulls per transport")
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS),
                   metavar="NAME", help=f"run only these, of {', '.join(SCENARIOS)} (slow and "
                   "early bring mixed's aggregated run, their baseline)")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every gateway, e.g. "
                   "--gateway-arg=--decode-interference-weight=0 (repeatable)")
    add_json_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging("warning")
    report = asyncio.run(_bench(args))
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
