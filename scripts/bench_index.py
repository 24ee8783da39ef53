#!/usr/bin/env python3
"""Benchmark the prefix index against Dynamo's Rust RadixTree on one realistic event stream.

Workload: 8 workers, block size 16, 20 shared system prompts of 8–128 blocks, 1,500 multi-turn
sessions (~8% carry a ~1,000-block document), each session sticky to one worker, each worker an
LRU prefix cache of 8,192 blocks that evicts leaf-first (as SGLang's radix cache does). The
stream is every stored/removed event those caches emit. Measured in one run, for us and (when
``ai-dynamo-runtime`` is importable) for ``dynamo.llm.RadixTree``:

* events applied per second: stored-only, removed-only and the mixed stream, from wire bytes
  (ours: our msgpack frames; Dynamo's: its JSON, which is what ``apply_event`` takes);
* match latency p50/p99 for 16-, 128- and 1,024-block requests;
* hashing time for a 1,024-block request from token ids;
* memory per indexed block.

By default it runs twice, pinned to one core and unpinned (Dynamo's tree pays a cross-thread
wake-up per call when not pinned), each in a fresh process. Ratios are ours vs Dynamo's,
oriented so that >= 1 means we are as good or better.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import statistics
import struct
import subprocess
import sys
import time
import tracemalloc
from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash
from benchkit import Better, Report, add_json_flag, print_table, progress

from kvcore import BlockHasher, Namespace
from kvcore.events import BlockRemoved, BlockStored, KVEvent, Tier
from kvcore.wire import decode, encode
from routing.placement.prefix_index import PrefixIndex

BLOCK_SIZE = 16
WORKERS = 8
CAPACITY_BLOCKS = 8192
MATCH_SIZES = (16, 128, 1024)


# --- workload ---------------------------------------------------------------------------


@dataclass
class Workload:
    events: list[KVEvent] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)  # content ids per request
    canon: dict[tuple[int, ...], int] = field(default_factory=dict)
    local_of: dict[int, int] = field(default_factory=dict)  # canonical hash → local hash


def _chain(content: list[int], cache: dict[int, int]) -> list[int]:
    """Canonical chained hashes of a prompt given as content-block ids (memoized by prefix)."""
    out, parent = [], 0
    for cid in content:
        key = (parent << 64) | cid
        h = cache.get(key)
        if h is None:
            h = xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, cid))
            cache[key] = h
        out.append(h)
        parent = h
    return out


def build_workload(sessions: int, seed: int = 7) -> tuple[Workload, dict[int, int]]:
    rng = random.Random(seed)
    next_id = iter(range(1, 1 << 62))
    systems = [[next(next_id) for _ in range(rng.randint(8, 128))] for _ in range(20)]
    weights = [1 / (i + 1) for i in range(20)]  # a few system prompts dominate
    plans = []
    for s in range(sessions):
        base = list(rng.choices(systems, weights)[0])
        if rng.random() < 0.08:
            base += [next(next_id) for _ in range(rng.randint(900, 1100))]
        turns = rng.randint(2, 8)
        plans.append((s % WORKERS if rng.random() < 0.5 else rng.randrange(WORKERS), base, turns))
    # Interleave the sessions' turns in time, keeping each session's turns in order.
    order = [s for s, (_, _, turns) in enumerate(plans) for _ in range(turns)]
    rng.shuffle(order)
    history = [list(p[1]) for p in plans]
    prefix_cache: dict[int, int] = {}
    local_of: dict[int, int] = {}
    sims = [_SimWorker(f"worker-{w}") for w in range(WORKERS)]
    work = Workload()
    for s in order:
        sim = sims[plans[s][0]]
        history[s] += [next(next_id) for _ in range(rng.randint(1, 8))]  # the user's turn
        reply = [next(next_id) for _ in range(rng.randint(1, 8))]
        prompt_hashes = _chain(history[s], prefix_cache)
        work.prompts.append(list(history[s]))
        history[s] += reply
        hashes = _chain(history[s], prefix_cache)
        for cid, h in zip(history[s], hashes, strict=True):
            local_of[h] = xxhash.xxh3_64_intdigest(struct.pack("<Q", cid))
        # Chunked prefill stores the prompt's missing blocks 32 at a time; decode then
        # stores each reply block as it fills (one event per block, as engines emit them).
        sim.serve(hashes, len(prompt_hashes), work.events)
    work.local_of = local_of
    return work, prefix_cache


class _SimWorker:
    """One engine's prefix cache: LRU over blocks, evicting leaf-first."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.parent: dict[int, int | None] = {}
        self.seq = 0

    def _emit(self, events: list[KVEvent], event: type, *args: object) -> None:
        self.seq += 1
        events.append(event(self.worker_id, 0, self.seq, Tier.GPU, *args))

    def serve(self, hashes: list[int], prompt_blocks: int, events: list[KVEvent]) -> None:
        hit = 0
        while hit < prompt_blocks and hashes[hit] in self.cache:
            hit += 1
        steps = [(i, min(i + 32, prompt_blocks)) for i in range(hit, prompt_blocks, 32)]
        steps += [(i, i + 1) for i in range(max(hit, prompt_blocks), len(hashes))]
        for start, end in steps:
            new = [h for h in hashes[start:end] if h not in self.cache]
            if new:
                parent = hashes[start - 1] if start else None
                self._emit(events, BlockStored, hashes[start:end], parent)
                for i in range(start, end):
                    self.parent[hashes[i]] = hashes[i - 1] if i else None
            for h in reversed(hashes[:end]):  # touch deepest first: parents stay more recent
                self.cache[h] = None
                self.cache.move_to_end(h)
            self._evict(events)

    def _evict(self, events: list[KVEvent]) -> None:
        # Leaf-first; one removal event per run up a chain (as a radix node's pages).
        run: list[int] = []
        run_parent: int | None = None
        while len(self.cache) > CAPACITY_BLOCKS:
            h, _ = self.cache.popitem(last=False)
            if run and run_parent != h:
                self._emit(events, BlockRemoved, run)
                run = []
            run.append(h)
            run_parent = self.parent.pop(h)
        if run:
            self._emit(events, BlockRemoved, run)


def renumber(events: list[KVEvent]) -> list[KVEvent]:
    seqs: dict[str, int] = {}
    out = []
    for e in events:
        seqs[e.worker_id] = seqs.get(e.worker_id, 0) + 1
        if isinstance(e, BlockStored):
            out.append(
                BlockStored(
                    e.worker_id, 0, seqs[e.worker_id], e.tier, e.block_hashes, e.parent_hash
                )
            )
        elif isinstance(e, BlockRemoved):
            out.append(BlockRemoved(e.worker_id, 0, seqs[e.worker_id], e.tier, e.block_hashes))
    return out


def drain_all(index: PrefixIndex, batch: int) -> list[KVEvent]:
    """Removal events that empty every worker, leaves first, in batches of ``batch`` blocks."""
    events: list[KVEvent] = []
    for worker_id in index.worker_ids:
        epoch, seq = index.position(worker_id)  # type: ignore[misc]
        blocks = list(index.worker_snapshot(worker_id).tiers[0].block_hashes)
        blocks.reverse()  # stored order reversed: children before parents
        for i in range(0, len(blocks), batch):
            seq += 1
            events.append(BlockRemoved(worker_id, epoch, seq, Tier.GPU, blocks[i : i + batch]))
    return events


def dynamo_json(event: KVEvent, event_id: int, local_of: dict[int, int]) -> bytes:
    if isinstance(event, BlockStored):
        data: object = {
            "stored": {
                "parent_hash": event.parent_hash,
                "blocks": [
                    {"block_hash": h, "tokens_hash": local_of[h]} for h in event.block_hashes
                ],
            }
        }
    elif isinstance(event, BlockRemoved):
        data = {"removed": {"block_hashes": list(event.block_hashes)}}
    else:
        data = "cleared"
    return json.dumps({"event_id": event_id, "dp_rank": 0, "data": data}).encode()


# --- measurement ------------------------------------------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _malloc_in_use() -> int:
    """Bytes the C heap has handed out (glibc mallinfo2): where Dynamo's Rust tree lives."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def blocks_in(events: list[KVEvent]) -> int:
    return sum(len(getattr(e, "block_hashes", ())) for e in events)


def time_ours(frames: list[bytes], setup: list[bytes] | None = None, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        index = PrefixIndex()
        for f in setup or ():
            index.apply(decode(f))  # type: ignore[arg-type]
        gc.collect()
        t = time.perf_counter()
        for f in frames:
            index.apply(decode(f))  # type: ignore[arg-type]
        best = min(best, time.perf_counter() - t)
    return best


def time_ours_decoded(events: list[KVEvent], reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        index = PrefixIndex()
        gc.collect()
        t = time.perf_counter()
        for e in events:
            index.apply(e)
        best = min(best, time.perf_counter() - t)
    return best


def time_dynamo(
    payloads: list[tuple[int, bytes]], setup: list[tuple[int, bytes]] | None = None, reps: int = 5
) -> float:
    from dynamo.llm import RadixTree

    best = float("inf")
    for _ in range(reps):
        tree = RadixTree()
        for w, p in setup or ():
            tree.apply_event(w, p)
        gc.collect()
        t = time.perf_counter()
        for w, p in payloads:
            tree.apply_event(w, p)
        best = min(best, time.perf_counter() - t)
    return best


def latency_us(fn, queries: list, rounds: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    samples = []
    clock = time.perf_counter_ns
    for _ in range(rounds):
        for q in queries:
            t = clock()
            fn(q)
            samples.append(clock() - t)
    samples.sort()
    return samples[len(samples) // 2] / 1e3, samples[int(len(samples) * 0.99)] / 1e3


def run_once(sessions: int, have_dynamo: bool) -> dict[str, float]:
    work, _ = build_workload(sessions)
    mixed = work.events
    stored = renumber([e for e in mixed if isinstance(e, BlockStored)])
    full = PrefixIndex()
    for e in stored:
        full.apply(e)
    removal_batch = max(
        1,
        round(
            blocks_in([e for e in mixed if isinstance(e, BlockRemoved)])
            / max(1, sum(isinstance(e, BlockRemoved) for e in mixed))
        ),
    )
    removed = drain_all(full, removal_batch)
    streams = {"stored": (stored, []), "removed": (removed, stored), "mixed": (mixed, [])}
    fig: dict[str, float] = {
        "stream_events": len(mixed),
        "stream_blocks": blocks_in(mixed),
    }
    # The prefix property, verified: replay the mixed stream and count orphaned blocks.
    check = PrefixIndex()
    for e in mixed:
        check.apply(e)
    fig["orphan_blocks_after_stream"] = check.orphan_blocks()
    fig["indexed_blocks_after_stream"] = check.num_blocks()

    worker_num = {f"worker-{i}": i for i in range(WORKERS)}
    for name, (events, setup) in streams.items():
        frames = [encode(e) for e in events]  # type: ignore[arg-type]
        setup_frames = [encode(e) for e in setup]  # type: ignore[arg-type]
        secs = time_ours(frames, setup_frames)
        fig[f"{name}_events_per_s"] = len(events) / secs
        fig[f"{name}_blocks_per_s"] = blocks_in(events) / secs
        if name == "mixed":
            dsecs = time_ours_decoded(events)
            fig["mixed_events_per_s_predecoded"] = len(events) / dsecs
        if have_dynamo:
            ids: dict[str, int] = {}

            def payload(e: KVEvent, ids: dict[str, int] = ids) -> tuple[int, bytes]:
                ids[e.worker_id] = ids.get(e.worker_id, 0) + 1
                return worker_num[e.worker_id], dynamo_json(e, ids[e.worker_id], work.local_of)

            dsetup = [payload(e) for e in setup]
            dpayloads = [payload(e) for e in events]
            dsecs = time_dynamo(dpayloads, dsetup)
            fig[f"dynamo_{name}_events_per_s"] = len(events) / dsecs
            fig[f"dynamo_{name}_blocks_per_s"] = blocks_in(events) / dsecs

    # Match latency on the final mixed state, for real prompts cut to each size.
    rng = random.Random(1)
    cache: dict[int, int] = {}
    tree = None
    if have_dynamo:
        from dynamo.llm import RadixTree

        tree = RadixTree()
        ids2: dict[int, int] = {}
        for e in mixed:
            w = worker_num[e.worker_id]
            ids2[w] = ids2.get(w, 0) + 1
            tree.apply_event(w, dynamo_json(e, ids2[w], work.local_of))
    for size in MATCH_SIZES:
        long_enough = [p for p in work.prompts if len(p) >= size]
        sample = rng.sample(long_enough, min(200, len(long_enough)))
        queries = [_chain(p[:size], cache) for p in sample]
        rounds = max(1, 6000 // len(queries))
        p50, p99 = latency_us(check.match, queries, rounds)
        fig[f"match_{size}_p50_us"], fig[f"match_{size}_p99_us"] = p50, p99
        fig[f"match_{size}_mean_workers"] = statistics.mean(len(check.match(q)) for q in queries)
        if tree is not None:
            locals_ = [[work.local_of[h] for h in q] for q in queries]
            p50, p99 = latency_us(tree.find_matches, locals_, rounds)
            fig[f"dynamo_match_{size}_p50_us"], fig[f"dynamo_match_{size}_p99_us"] = p50, p99

    # Hashing a 1,024-block request from token ids.
    hasher = BlockHasher(BLOCK_SIZE)
    seed = Namespace("bench-model").seed
    tokens = [rng.randrange(150_000) for _ in range(1024 * BLOCK_SIZE)]
    p50, _ = latency_us(lambda t: hasher.hash_tokens(t, seed), [tokens], 400)
    fig["hash_1024_blocks_us"] = p50
    if have_dynamo:
        from dynamo.llm import compute_block_hash_for_seq

        p50, _ = latency_us(lambda t: compute_block_hash_for_seq(t, BLOCK_SIZE), [tokens], 400)
        fig["dynamo_hash_1024_blocks_us"] = p50

    # Memory per indexed block: traced Python heap for ours, C-heap growth for Dynamo's tree.
    # Strict: built from wire frames, as the gateway does, so the hash int objects the index
    # keeps are counted; "predecoded" (the earlier figure) shares them with the event list.
    frames = [encode(e) for e in mixed]
    for name, source in (("bytes_per_block", frames), ("bytes_per_block_predecoded", mixed)):
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        mem_index = PrefixIndex()
        for item in source:
            mem_index.apply(decode(item) if isinstance(item, bytes) else item)  # type: ignore[arg-type]
        fig[name] = (tracemalloc.get_traced_memory()[0] - before) / mem_index.num_blocks()
        tracemalloc.stop()
    fig["bytes_per_block_estimate"] = mem_index.memory_bytes() / mem_index.num_blocks()
    if have_dynamo:
        from dynamo.llm import RadixTree

        payloads = []
        ids3: dict[int, int] = {}
        for e in mixed:
            w = worker_num[e.worker_id]
            ids3[w] = ids3.get(w, 0) + 1
            payloads.append((w, dynamo_json(e, ids3[w], work.local_of)))
        gc.collect()
        start = _malloc_in_use()
        big = RadixTree()
        for w, p in payloads:
            big.apply_event(w, p)
        fig["dynamo_bytes_per_block"] = (_malloc_in_use() - start) / mem_index.num_blocks()
        fig["dynamo_bytes_per_block_predecoded"] = fig["dynamo_bytes_per_block"]
    return fig


# --- reporting --------------------------------------------------------------------------

# our figure (Dynamo's: dynamo_<figure>) → which way is better
COMPARED: dict[str, Better] = {
    "stored_events_per_s": "higher",
    "stored_blocks_per_s": "higher",
    "removed_events_per_s": "higher",
    "removed_blocks_per_s": "higher",
    "mixed_events_per_s": "higher",
    "mixed_blocks_per_s": "higher",
    **{f"match_{n}_{q}_us": "lower" for n in MATCH_SIZES for q in ("p50", "p99")},
    "hash_1024_blocks_us": "lower",
    "bytes_per_block": "lower",
    "bytes_per_block_predecoded": "lower",
}


def pass_report(fig: dict[str, float]) -> Report:
    """One pass's figures, and its ratios against Dynamo's where both were measured."""
    report = Report()
    report.add_figures(fig)
    for name, better in COMPARED.items():
        theirs = fig.get(f"dynamo_{name}")
        ours = fig.get(name)
        if theirs and ours:
            report.ratio(name, "dynamo", ours, theirs, better=better)
    return report


def print_pass(mode: str, report: Report) -> None:
    fig = report.figures
    print(
        f"\n== {mode} ==  stream: {fig['stream_events']:.0f} events, "
        f"{fig['stream_blocks']:.0f} blocks; orphaned blocks after it: "
        f"{fig['orphan_blocks_after_stream']:.0f} of {fig['indexed_blocks_after_stream']:.0f}"
    )
    print_table(
        ["figure", "kvsidecar", "dynamo", "ratio"],
        [[name, fig[name], fig.get(f"dynamo_{name}"), report.ratios.get(f"{name}_vs_dynamo")]
         for name in COMPARED if name in fig]
        + [["mixed_events_per_s (pre-decoded)", fig["mixed_events_per_s_predecoded"]],
           ["bytes_per_block (estimate)", fig["bytes_per_block_estimate"]]],
    )
    print("ratio >= 1: kvsidecar as good or better")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_json_flag(parser)
    parser.add_argument("--sessions", type=int, default=1500, help="multi-turn sessions (1500)")
    parser.add_argument("--quick", action="store_true", help="300 sessions, pinned pass only")
    parser.add_argument(
        "--modes",
        default="pinned,unpinned",
        help="comma-separated passes: pinned (one core), unpinned",
    )
    parser.add_argument("--single", choices=["pinned", "unpinned"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions, args.modes = 300, "pinned"

    if args.single:
        if args.single == "pinned":
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        try:
            import dynamo.llm  # noqa: F401

            have_dynamo = True
        except ImportError:
            have_dynamo = False
        print(json.dumps(run_once(args.sessions, have_dynamo)))
        return 0

    report = Report()
    for mode in args.modes.split(","):
        progress(f"running {mode} pass ({args.sessions} sessions)...")
        out = subprocess.run(
            [sys.executable, __file__, "--single", mode, "--sessions", str(args.sessions)],
            capture_output=True,
            text=True,
            check=True,
        )
        one = pass_report(json.loads(out.stdout.strip().splitlines()[-1]))
        print_pass(mode, one)
        report.include(one, prefix=f"{mode}.")
    if not any(name.endswith(".dynamo_stored_events_per_s") for name in report.figures):
        print("\n(dynamo.llm not importable: install ai-dynamo-runtime to compare)")
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
