#!/usr/bin/env python3
"""The prefix index at fleet scale: 128 workers, 10 M indexed blocks, next to Dynamo's Rust
``RadixTree`` (``ai-dynamo-runtime``) holding the same blocks.

Workload (``--workers``, ``--blocks``): 512 system prompts of 64 blocks; each worker holds 16
of them (so a shared block sits on ~4 workers) and, under them, conversations of its own,
256 blocks a turn and up to 2,048 deep, until the fleet holds ``--blocks`` (worker, block)
pairs. It arrives as the
events an engine publishes: a ``BlockStored`` of up to 64 blocks, chained parent → child.
Each side runs in a fresh process, one after the other, and reports:

* ingest: events applied per second, and blocks per second, from wire bytes (ours: our
  msgpack frames, as the gateway's feed decodes them; Dynamo's: the JSON its
  ``apply_event`` takes);
* match latency p50 / p99 of 128- and 1,024-block requests that are real prefixes held by
  some workers (ours: ``PrefixIndex.match``; Dynamo's: ``find_matches``);
* memory: the process's resident set growth while it built the index (``VmRSS``), per
  indexed block, and the process's whole RSS at the end (what a gateway holding this index
  would use, beside its own code).

Ratios are ours vs Dynamo's, oriented so that >= 1 is as good or better.

    python scripts/bench_fleet.py [--workers 128] [--blocks 10000000] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from bench_index import latency_us  # the index benchmark's percentiles, the same way
from benchkit import Better, Report, add_json_flag, print_table, progress

from kvcore.events import BlockStored, Tier
from kvcore.wire import decode, encode
from routing.placement.prefix_index import PrefixIndex

SYSTEM_PROMPTS = 512
SYSTEM_BLOCKS = 64
PROMPTS_PER_WORKER = 16
CONVERSATION_BLOCKS = 256  # a turn's new blocks
MAX_THREAD_BLOCKS = 2048  # a conversation's depth at most
EVENT_BLOCKS = 64
MATCH_SIZES = (128, 1024)
QUERIES = 200


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class Fleet:
    """The blocks each worker holds, as chains: (worker, parent, blocks) per event."""

    def __init__(self, workers: int, blocks: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.workers = workers
        self._rng = rng
        systems = [self._chain(SYSTEM_BLOCKS) for _ in range(SYSTEM_PROMPTS)]
        per_worker = blocks // workers
        self.chains: list[tuple[int, int | None, list[int]]] = []
        self.prompts: list[list[int]] = []  # full prefixes, for match queries
        for w in range(workers):
            mine = rng.sample(systems, PROMPTS_PER_WORKER)
            held = 0
            for system in mine:
                self._add(w, None, system)
                held += len(system)
            thread = rng.choice(mine)  # a conversation's blocks so far
            while held < per_worker:
                if len(thread) >= MAX_THREAD_BLOCKS or rng.random() < 0.25:
                    thread = rng.choice(mine)  # a new conversation on a system prompt
                n = min(CONVERSATION_BLOCKS, per_worker - held)
                turn = self._chain(n)
                self._add(w, thread[-1], turn)
                held += n
                thread = thread + turn
                if len(self.prompts) < 4 * QUERIES or rng.random() < 0.01:
                    self.prompts.append(thread)

    def _chain(self, n: int) -> list[int]:
        return [self._rng.getrandbits(63) | 1 for _ in range(n)]

    def _add(self, worker: int, parent: int | None, blocks: list[int]) -> None:
        for i in range(0, len(blocks), EVENT_BLOCKS):
            self.chains.append((worker, parent if i == 0 else blocks[i - 1],
                                blocks[i : i + EVENT_BLOCKS]))

    def queries(self, size: int) -> list[list[int]]:
        rng = random.Random(size)
        fit = [p for p in self.prompts if len(p) >= size]
        return [p[:size] for p in rng.sample(fit, min(QUERIES, len(fit)))]


def run_ours(fleet: Fleet) -> dict[str, float]:
    seqs = [0] * fleet.workers
    frames = []
    for w, parent, blocks in fleet.chains:
        seqs[w] += 1
        frames.append(encode(BlockStored(f"w{w}", 1, seqs[w], Tier.GPU, blocks, parent)))
    queries = {size: fleet.queries(size) for size in MATCH_SIZES}
    blocks = sum(len(c[2]) for c in fleet.chains)
    del fleet
    gc.collect()
    base = rss_bytes()
    index = PrefixIndex()
    t = time.perf_counter()
    for frame in frames:
        index.apply(decode(frame))  # type: ignore[arg-type]
    secs = time.perf_counter() - t
    fig = {"events_per_s": len(frames) / secs, "blocks_per_s": blocks / secs,
           "indexed_blocks": float(index.num_blocks()), "workers": float(len(index.worker_ids))}
    del frames
    gc.collect()
    fig["rss_bytes_per_block"] = (rss_bytes() - base) / index.num_blocks()
    for size, qs in queries.items():
        fig[f"match_{size}_p50_us"], fig[f"match_{size}_p99_us"] = latency_us(
            index.match, qs, max(1, 2000 // len(qs)))
    fig["rss_total_mib"] = rss_bytes() / 2**20
    return fig


def run_dynamo(fleet: Fleet) -> dict[str, float]:
    from dynamo.llm import RadixTree

    queries = {size: fleet.queries(size) for size in MATCH_SIZES}
    blocks = sum(len(c[2]) for c in fleet.chains)
    gc.collect()
    base = rss_bytes()
    tree = RadixTree()
    seqs = [0] * fleet.workers
    secs = 0.0
    for w, parent, chain in fleet.chains:  # JSON made per event, not timed, not kept
        seqs[w] += 1
        payload = json.dumps({"event_id": seqs[w], "dp_rank": 0, "data": {"stored": {
            "parent_hash": parent,
            "blocks": [{"block_hash": h, "tokens_hash": h} for h in chain]}}}).encode()
        t = time.perf_counter()
        tree.apply_event(w, payload)
        secs += time.perf_counter() - t
    events = len(fleet.chains)
    del fleet
    gc.collect()
    fig = {"events_per_s": events / secs, "blocks_per_s": blocks / secs,
           "rss_bytes_per_block": (rss_bytes() - base) / blocks}
    for size, qs in queries.items():
        fig[f"match_{size}_p50_us"], fig[f"match_{size}_p99_us"] = latency_us(
            tree.find_matches, qs, max(1, 2000 // len(qs)))
    fig["rss_total_mib"] = rss_bytes() / 2**20
    return fig


# figure → which way is better
COMPARED: dict[str, Better] = {
    "events_per_s": "higher",
    "blocks_per_s": "higher",
    **{f"match_{s}_{q}_us": "lower" for s in MATCH_SIZES for q in ("p50", "p99")},
    "rss_bytes_per_block": "lower",
    "rss_total_mib": "lower",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_fleet.py",
                                description=(__doc__ or "").split("\n\n")[0].replace("\n", " "))
    p.add_argument("--workers", type=int, default=128)
    p.add_argument("--blocks", type=int, default=10_000_000,
                   help="(worker, block) pairs the fleet holds (default 10,000,000)")
    add_json_flag(p)
    p.add_argument("--side", choices=["ours", "dynamo"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    min_blocks = args.workers * PROMPTS_PER_WORKER * SYSTEM_BLOCKS
    if args.workers < PROMPTS_PER_WORKER or args.blocks < min_blocks:
        p.error(f"--workers must be >= {PROMPTS_PER_WORKER} and --blocks >= {min_blocks} "
                "(every worker holds its system prompts)")
    if args.side:  # one side, in this fresh process: its figures as one JSON line
        fleet = Fleet(args.workers, args.blocks)
        fig = run_ours(fleet) if args.side == "ours" else run_dynamo(fleet)
        print(json.dumps(fig))
        return 0
    results: dict[str, dict[str, float]] = {}
    for side in ("ours", "dynamo"):
        progress(f"{side}: {args.workers} workers, {args.blocks:,} blocks (a fresh process)")
        out = subprocess.run([sys.executable, __file__, "--side", side, "--workers",
                              str(args.workers), "--blocks", str(args.blocks)],
                             capture_output=True, text=True, check=False)
        if out.returncode:
            if side == "dynamo" and "No module named 'dynamo'" in out.stderr:
                progress("dynamo: ai-dynamo-runtime is not installed; ours only")
                continue
            raise SystemExit(f"the {side} run failed:\n{out.stderr[-3000:]}")
        results[side] = json.loads(out.stdout.strip().splitlines()[-1])
    ours, theirs = results["ours"], results.get("dynamo", {})
    report = Report()
    report.add_figures(ours)
    report.add_figures(theirs, prefix="dynamo_")
    for name, better in COMPARED.items():
        if name in theirs:
            report.ratio(name, "dynamo", ours[name], theirs[name], better=better)
    print(f"\n{ours['indexed_blocks']:,.0f} indexed blocks on {ours['workers']:.0f} workers\n")
    print_table(["figure", "kvsidecar", "dynamo", "ratio"],
                [[name, ours[name], theirs.get(name),
                  report.ratios.get(f"{name}_vs_dynamo")] for name in COMPARED])
    print("ratio >= 1: kvsidecar as good or better")
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
