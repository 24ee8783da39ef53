#!/usr/bin/env python3
"""Moving a hot prefix to a light worker, against herding onto its holder and against
recomputing it there, on one fleet in one run.

The fleet: ``--workers`` reference engines (simulated compute: the timing model of an 8B model
on one datacenter GPU, about 20k prefill tokens/s), each with its HiCache hook on its own
sidecar's block store, so every page an engine computes is written through to its store,
where a peer's sidecar can pull it (shm: one host).

The load comes in waves. Each wave a new system prompt becomes hot: one request brings it to
one worker (the holder), then a burst of ``--burst`` requests share it (the system prompt and
a short user message each; streamed; ``--output-tokens`` each). Three gateways over the same
workers, each given its own prompts, take turns wave by wave:

* ``herd``: the prefix decides: ``--overlap-weight 100`` (a cached block outweighs a hundred
  blocks of queue), so the burst piles onto the holder, as the learned weights did on the
  hot-prefix load of issue 32;
* ``recompute``: Dynamo's default cost (``--overlap-weight 1 --prefill-load-scale 1``) with
  ``--kv-move off``: the burst spreads where the holder's load outweighs the prefix, and a
  light worker prefills the whole prompt;
* ``move``: the same cost with ``--kv-move on``: a light worker's sidecar pulls the prefix
  from the holder's store before prefill, when the cost model says the pull wins.

The weights are fixed so that the three differ in one thing each (the learned weights of the
gateway's defaults keep this burst on the holder: its queue never outweighs 4,000 cached
tokens at the prior prefill load scale of 10). ``--warmup-waves`` run first, unmeasured:
the first pull between two sidecars maps the holder's segment (a few hundred ms here), once.

Per mode: TTFT p50/p99 and ITL p50 over the bursts' requests, requests/s (burst requests over
the bursts' wall time), the share of prompt tokens the engines reported cached, the busiest
worker's share of a burst's requests (mean over the waves), and the requests placed as
``moved``; for the move, the pulls' measured GB/s and the price the planner put on them.
Ratios (>= 1: the move as good or better): ``<figure>_vs_herding`` and
``<figure>_vs_recompute``.

    python scripts/bench_kv_move.py [--waves 8] [--burst 12] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from benchkit import ROOT, Report, add_json_flag, print_table, progress

from kvcore import BlockHasher, Namespace
from kvsidecar.local_stack import EngineSpec, GatewaySpec, LocalStack, StackSpec
from shm import BlockStoreClient

MODEL = ROOT / "refengine" / "models" / "tiny"
PAGE_TOKENS = 16
FIXED = ["--overlap-weight", "1", "--prefill-load-scale", "1"]  # Dynamo's default cost
MODES = {
    "herd": ["--kv-move", "off", "--overlap-weight", "100", "--prefill-load-scale", "1"],
    "recompute": ["--kv-move", "off", *FIXED],
    "move": ["--kv-move", "on", *FIXED],
}
BASELINES = {"herd": "herding", "recompute": "recompute"}


@dataclass
class Sample:
    ttft_s: float
    itl_s: float | None
    worker: str
    reason: str
    prompt_tokens: int
    cached_tokens: int


@dataclass
class ModeRun:
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    busiest: list[float] = field(default_factory=list)  # per wave: the busiest worker's share


async def generate(session: aiohttp.ClientSession, url: str, ids: list[int]) -> None:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    async with session.post(url + "/generate", json=body) as resp:
        resp.raise_for_status()
        await resp.read()


async def hook_attached(session: aiohttp.ClientSession, url: str, sock: Path | None) -> None:
    """One-page prompts until one reaches the store (the hook retries its store each second)."""
    assert sock is not None  # EngineSpec(store="hook")
    with BlockStoreClient(str(sock)) as store:
        for warmup in range(1000):
            await generate(session, url, [warmup + 1] * (PAGE_TOKENS + 1))
            if store.stats().num_puts:
                return
            await asyncio.sleep(0.2)  # a bench, not a test: pace the warm-up prompts
    raise RuntimeError(f"the HiCache hook of {url} never attached")


async def stream_one(session: aiohttp.ClientSession, gateway: str, ids: list[int],
                     max_tokens: int) -> Sample:
    body = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = 0.0
    tokens = 0
    usage: dict[str, Any] = {}
    async with session.post(f"{gateway}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {await resp.text()}")
        worker = resp.headers.get("x-kvsidecar-worker", "")
        reason = resp.headers.get("x-kvsidecar-placement-reason", "")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices", ())):
                now = time.perf_counter()
                first = first or now
                last = now
                tokens += 1
    itl = (last - first) / (tokens - 1) if tokens > 1 else None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Sample(first - t0, itl, worker, reason, int(usage.get("prompt_tokens", len(ids))),
                  int(cached))


def stack_spec(args: argparse.Namespace) -> StackSpec:
    """The fleet: one simulated engine process per worker (``w<i>``), its HiCache hook on
    its own sidecar's block store; the three modes' gateways over all of them."""
    pages = args.system_tokens // PAGE_TOKENS + 64
    store = str(args.store_pages * PAGE_TOKENS * 2048)  # the tiny model: 2 KiB per token
    engines = tuple(EngineSpec(store="hook", worker_ids=(f"w{i}",),
                               args=("--hicache-host-pages", str(pages)),
                               sidecar_args=("--store-capacity-bytes", store))
                    for i in range(args.workers))
    gateways = tuple(GatewaySpec(name=f"gateway-{mode}", seed=1, args=tuple(flags),
                                 health_check_interval_s=None)
                     for mode, flags in MODES.items())
    return StackSpec(engines=engines, gateways=gateways, model_path=str(MODEL),
                     speedup=args.speedup)


class Bench:
    def __init__(self, args: argparse.Namespace, stack: LocalStack) -> None:
        self.args = args
        self.engines = [(part.url, part.store_socket) for part in stack.engines]
        self.gateways = {mode: next(g.url for g in stack.gateways if g.name == f"gateway-{mode}")
                         for mode in MODES}
        self.sidecars = stack.sidecar_urls  # worker id → sidecar URL
        self.hasher = BlockHasher(PAGE_TOKENS)
        self.seed = Namespace("tiny").seed  # the model's canonical namespace
        self.move_metrics = ""  # the move gateway's /metrics at the end

    async def run(self) -> dict[str, ModeRun]:
        a = self.args
        runs = {mode: ModeRun() for mode in MODES}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await asyncio.gather(*(hook_attached(session, url, sock)
                                   for url, sock in self.engines))
            unmeasured = {mode: ModeRun() for mode in MODES}
            for wave in range(a.warmup_waves + a.waves):
                measured = wave >= a.warmup_waves
                for m, mode in enumerate(MODES):
                    progress(f"wave {wave + 1}/{a.warmup_waves + a.waves}: {mode}"
                             + ("" if measured else " (warm-up)"))
                    await self._wave(session, mode, wave * len(MODES) + m,
                                     (runs if measured else unmeasured)[mode])
            async with session.get(f"{self.gateways['move']}/metrics") as resp:
                self.move_metrics = await resp.text()
        return runs

    async def _wave(self, session: aiohttp.ClientSession, mode: str, n: int,
                    run: ModeRun) -> None:
        a = self.args
        gateway = self.gateways[mode]
        system = [(i * (2 * n + 3) + 17 * n) % 900 + 5 for i in range(a.system_tokens)]

        def request(k: int) -> list[int]:
            return system + [(j * 7 + k * 131 + n) % 900 + 5 for j in range(a.user_tokens)]

        holder = (await stream_one(session, gateway, request(0), 1)).worker  # computes it
        # Its pages reach the holder's store (and, by events, the gateway's index) first.
        hashes = self.hasher.hash_tokens(system, self.seed)
        sidecar = self.sidecars[holder]
        for _ in range(1000):
            async with session.post(f"{sidecar}/v1/blocks/named",
                                    json={"block_hashes": hashes}) as resp:
                if len((await resp.json())["keys"]) == len(hashes):
                    break
            await asyncio.sleep(0.02)
        else:
            raise RuntimeError(f"{holder}'s store never held the hot prompt")
        started = time.perf_counter()
        samples = await asyncio.gather(*(stream_one(session, gateway, request(k),
                                                    a.output_tokens)
                                         for k in range(1, a.burst + 1)))
        run.wall_s += time.perf_counter() - started
        run.samples += samples
        run.busiest.append(max(Counter(x.worker for x in samples).values()) / len(samples))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def figures(run: ModeRun) -> dict[str, float]:
    s = run.samples
    ttft = [x.ttft_s for x in s]
    itl = [x.itl_s for x in s if x.itl_s is not None]
    return {
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": pct(ttft, 0.99),
        "itl_p50_s": statistics.median(itl) if itl else 0.0,
        "requests_per_s": len(s) / run.wall_s,
        "cached_share": sum(x.cached_tokens for x in s) / sum(x.prompt_tokens for x in s),
        "busiest_worker_share": statistics.mean(run.busiest),
        "moved_requests": sum(x.reason == "moved" for x in s),
    }


def sample(metrics: str, name: str) -> float:
    """The value of the exposition line ``name`` (0 when absent)."""
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_kv_move.py",
                                description=(__doc__ or "").split("\n\n")[0].replace("\n", " "))
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--waves", type=int, default=8, help="hot prompts per mode")
    p.add_argument("--warmup-waves", type=int, default=2, help="unmeasured waves first")
    p.add_argument("--burst", type=int, default=12, help="requests sharing each hot prompt")
    p.add_argument("--system-tokens", type=int, default=4000)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--store-pages", type=int, default=1024, help="each sidecar's store")
    p.add_argument("--speedup", type=float, default=0.25,
                   help="the engines' --speedup: below 1 the simulated GPU is slower, so its "
                   "timing, not this machine's CPUs, decides")
    add_json_flag(p)
    args = p.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory(prefix="bench-kv-move-") as tmp, \
            LocalStack(stack_spec(args), Path(tmp)) as stack:
        bench = Bench(args, stack)
        runs = asyncio.run(bench.run())
    report = Report()
    figs = {mode: figures(run) for mode, run in runs.items()}
    for mode, values in figs.items():
        report.add_figures(values, prefix=f"{mode}.")
    move = figs["move"]
    g = "kvsidecar_gateway_kv_move"
    for name, metric in (("pull_gbytes_per_s", f"{g}_pull_gbytes_per_second"),
                         ("pull_ratio", f"{g}_pull_ratio"),
                         ("pulls_ok", f'{g}s_total{{outcome="ok"}}')):
        report.figure(f"move.{name}", sample(bench.move_metrics, metric))
    for mode, baseline in BASELINES.items():
        for name, better in (("ttft_p50_s", "lower"), ("ttft_p99_s", "lower"),
                             ("itl_p50_s", "lower"), ("requests_per_s", "higher")):
            if figs[mode][name] > 0 and move[name] > 0:
                report.ratio(name, baseline, move[name], figs[mode][name],
                             better=better)  # type: ignore[arg-type]
    names = list(move)
    print_table(["mode", *names], [[mode, *(f"{figs[mode][n]:.4g}" for n in names)]
                                   for mode in figs])
    report.print_ratios("moving the prefix")
    if args.json is not None:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
