#!/usr/bin/env python3
"""Benchmark a gateway's warm start from JetStream (``--events-via nats``): how long a new
gateway takes to hold the full index of ``--blocks`` indexed blocks and place by it.

One local ``nats-server`` (JetStream). ``--workers`` sidecar relays (``sidecar.relay`` +
``sidecar.event_stream`` with the real ``JetStreamPublisher``, in this process) publish a
fleet's events to the model's stream: chains of 8–64 new blocks, a third of them extending
an earlier chain's prefix, until ``--blocks`` (worker, block) pairs are held and ``--churn``
times as many were stored (the oldest chains evicted: what the stream's retention holds).
Gateway A (``routing.replicas.durable.DurableEvents`` over a ``KvRouter``) reads the stream
and writes its index snapshot; then a tail of ``--tail-fraction`` more events is published.
Then, each on a fresh router:

- **warm start**: a new ``DurableEvents`` from nothing to live: connect, read and load the
  newest snapshot, replay the tail (the median of ``--repeats``); then one placement by the
  full index;
- **full replay**: the same with no snapshot in the bucket: the whole stream replayed.

Both end equal to A's index (checked). Also measured apart: writing a snapshot (the copy the
gateway's loop makes every ``--snapshot-interval-s``, the packing a thread does, and the
longest the loop waited meanwhile), and a snapshot's fetch, decode and load.

Prints a table; ``--json FILE`` writes ``{"figures": {...}, "ratios": {...}}``. Ratios (>= 1:
as good or better): ``warm_start_s_vs_target`` (1 s / the warm start) and
``warm_start_vs_full_replay`` (full replay / warm start, measured in the same run).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import msgspec
from benchkit import Report, add_json_flag

from kvcore import nats_extra
from kvcore.events import BlockRemoved, BlockStored, KVEvent, Tier
from kvcore.jetstream import snapshot_bucket, stream_name
from kvsidecar.local_nats import NatsServer
from routing.placement.kv_router import KvRouter
from routing.replicas.durable import DurableEvents
from routing.replicas.snapshots import SnapshotStore, decode_snapshot
from sidecar.event_stream import EventStream
from sidecar.jetstream_publisher import JetStreamPublisher
from sidecar.relay import EventRelay

MODEL = "bench"
TARGET_S = 1.0
CPU_S: dict[str, float] = {}  # a gateway's start in this process's CPU seconds (on a busy
# machine the wall time also holds other processes' turns; nats-server is not counted)


def fleet_events(workers: int, blocks: int, churn: float,
                 seed: int) -> tuple[list[KVEvent], list[list[int]]]:
    """Unstamped events until ``blocks`` (worker, block) pairs are held and ``churn`` times as
    many were stored over the stream's history; the chains still held. A worker evicts its
    oldest chain, leaf first, each block once no chain of its own still holds it."""
    rng = random.Random(seed)
    events: list[KVEvent] = []
    held: dict[str, deque[list[int]]] = {f"worker-{w}": deque() for w in range(workers)}
    refs: dict[str, dict[int, int]] = {w: {} for w in held}  # block → its chains holding it
    stored: list[list[int]] = []  # every chain ever stored (a new one may extend any)
    num_held = num_stored = 0
    while num_stored < churn * blocks or num_held < blocks:
        worker = f"worker-{rng.randrange(workers)}"
        chain = [rng.getrandbits(64) for _ in range(rng.randrange(8, 65))]
        if stored and rng.random() < 0.33:  # a shared prefix, extended
            base = rng.choice(stored)
            chain = base[: rng.randrange(1, len(base) + 1)] + chain
        events.append(BlockStored(worker, 0, 0, Tier.GPU, chain, None))
        stored.append(chain)
        held[worker].append(chain)
        counts = refs[worker]
        for block in chain:
            counts[block] = counts.get(block, 0) + 1
            num_held += counts[block] == 1
            num_stored += counts[block] == 1
        while num_held > blocks:  # evict the oldest chain of a worker that has one
            victim = rng.choice([w for w, chains in held.items() if chains])
            counts, gone = refs[victim], []
            for block in reversed(held[victim].popleft()):
                counts[block] -= 1
                if not counts[block]:
                    del counts[block]
                    gone.append(block)
            if gone:
                events.append(BlockRemoved(victim, 0, 0, Tier.GPU, gone))
                num_held -= len(gone)
    return events, [c for chains in held.values() for c in chains]


async def publish(streams: dict[str, EventStream], publisher: JetStreamPublisher,
                  events: list[KVEvent]) -> float:
    """Publish through the relays; seconds until JetStream has every frame."""
    m = publisher.metrics
    started = time.perf_counter()
    until = m.frames_published - m.markers_published + len(events)
    for i, event in enumerate(events):
        streams[event.worker_id].publish(event)
        if i % 512 == 511:
            await asyncio.sleep(0)  # the publisher's turn, as the sidecar's loop gives it
    while m.frames_published - m.markers_published < until:
        assert not m.frames_dropped, "the publisher dropped frames"
        await asyncio.sleep(0.001)
    return time.perf_counter() - started


async def longest_stall(work: Coroutine[Any, Any, None]) -> float:
    """Run ``work``; the longest the event loop went without running another task meanwhile
    (what requests in flight would wait)."""
    longest = 0.0
    done = False

    async def tick() -> None:
        nonlocal longest
        while not done:
            before = time.perf_counter()
            await asyncio.sleep(0)
            longest = max(longest, time.perf_counter() - before)

    ticker = asyncio.create_task(tick())
    await work
    done = True
    await ticker
    return longest


async def caught_up(durable: DurableEvents, last_seq: int) -> None:
    while durable.metrics.stream_seq < last_seq or not durable.live():
        await asyncio.sleep(0.001)


async def stream_last_seq(js: Any) -> int:
    info = await js.stream_info(stream_name(MODEL))
    return int(info.state.last_seq)


async def start_gateway(url: str, name: str) -> tuple[KvRouter, DurableEvents, asyncio.Task[None],
                                                       float]:
    """A fresh router and its durable events, from nothing to live; seconds it took."""
    router = KvRouter(block_size=16)
    durable = DurableEvents(router, url=url, model_id=MODEL, replica_id=name,
                            snapshot_interval_s=0)
    started, cpu = time.perf_counter(), time.process_time()
    task = asyncio.create_task(durable.run())
    while not durable.live():
        await asyncio.sleep(0.0005)
    CPU_S[name] = time.process_time() - cpu
    return router, durable, task, time.perf_counter() - started


async def run(args: argparse.Namespace, nats_url: str) -> dict[str, float]:
    figures: dict[str, float] = {}
    nats = nats_extra.load("bench_warm_start.py")
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    events, chains = fleet_events(args.workers, args.blocks, args.churn, args.seed)
    tail_at = int(len(events) * (1 - args.tail_fraction))
    streams = {f"worker-{w}": EventStream(EventRelay(f"worker-{w}", block_size=16,
                                                     model_id=MODEL))
               for w in range(args.workers)}
    publisher = JetStreamPublisher(streams, url=nats_url, model_id=MODEL, max_age_s=3600,
                                   max_bytes=8 << 30, queue_frames=1 << 20)
    pub_task = asyncio.create_task(publisher.run())
    while not publisher.metrics.connected:
        await asyncio.sleep(0.01)
    seconds = await publish(streams, publisher, events[:tail_at])
    figures["publish_events_per_s"] = round(tail_at / seconds)

    # Gateway A: reads everything, writes its snapshot.
    a_router, a, a_task, _ = await start_gateway(nats_url, "a")
    await caught_up(a, await stream_last_seq(js))
    blocks = a_router.index.num_blocks()
    started = time.perf_counter()
    a_router.index.copy()
    figures["snapshot_copy_s"] = round(time.perf_counter() - started, 4)
    started = time.perf_counter()
    image = a_router.index.to_image()
    figures["snapshot_pack_s"] = round(time.perf_counter() - started, 4)
    started = time.perf_counter()
    figures["snapshot_loop_stall_ms"] = round(await longest_stall(a.write_snapshot()) * 1000, 1)
    figures["snapshot_write_s"] = round(time.perf_counter() - started, 4)
    raw = msgspec.msgpack.encode(image)
    figures["indexed_blocks"] = blocks
    figures["snapshot_bytes_per_block"] = round(len(raw) / blocks, 1)

    # The tail, after the snapshot.
    await publish(streams, publisher, events[tail_at:])
    last = await stream_last_seq(js)
    await caught_up(a, last)
    figures["stream_messages"] = last
    figures["events"] = len(events)

    # The snapshot's parts, apart.
    store = SnapshotStore(nats, js, MODEL)
    started = time.perf_counter()
    data = await store.read_newest()
    figures["snapshot_fetch_s"] = round(time.perf_counter() - started, 4)
    assert data is not None
    started = time.perf_counter()
    snapshot = decode_snapshot(data)
    figures["snapshot_decode_s"] = round(time.perf_counter() - started, 4)
    started = time.perf_counter()
    KvRouter(block_size=16).index.load_image(snapshot.image)
    figures["snapshot_load_s"] = round(time.perf_counter() - started, 4)

    # Warm start: snapshot + tail; then place one known prefix. The median of --repeats.
    warm, cpu = [], []
    b_task: asyncio.Task[None] | None = None
    for r in range(args.repeats):
        if b_task is not None:
            b_task.cancel()
            await asyncio.gather(b_task, return_exceptions=True)
        b_router, b, b_task, seconds = await start_gateway(nats_url, f"b{r}")
        await caught_up(b, last)
        warm.append(seconds)
        cpu.append(CPU_S[f"b{r}"])
    started = time.perf_counter()
    chain = chains[len(chains) // 2]
    placement = b_router.place(chain, len(chain) * 16, sorted(streams))
    figures["first_place_ms"] = round((time.perf_counter() - started) * 1000, 3)
    assert placement is not None and placement.overlap.longest > 0, "the prefix is not indexed"
    figures["warm_start_s"] = round(statistics.median(warm), 4)
    figures["warm_start_min_s"] = round(min(warm), 4)
    figures["warm_start_cpu_s"] = round(statistics.median(cpu), 4)
    figures["warm_start_replayed_messages"] = last - snapshot.stream_seq

    # Full replay: no snapshot to start from.
    obs = await js.object_store(snapshot_bucket(MODEL))
    await obs.delete("index-a")
    c_router, _, c_task, full = await start_gateway(nats_url, "c")
    figures["full_replay_s"] = round(full, 4)
    figures["full_replay_cpu_s"] = round(CPU_S["c"], 4)

    for router in (b_router, c_router):
        assert router.index.num_blocks() == a_router.index.num_blocks()
        for probe in random.Random(1).sample(chains, min(500, len(chains))):
            assert router.index.match_tiers(probe) == a_router.index.match_tiers(probe)
    tasks = (a_task, b_task, c_task, pub_task)
    for task in tasks:
        if task is not None:
            task.cancel()
    await asyncio.gather(*(t for t in tasks if t is not None), return_exceptions=True)
    await nc.close()
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=1_000_000, help="indexed blocks (default 1M)")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--tail-fraction", type=float, default=0.01,
                   help="events published after the snapshot (default 0.01)")
    p.add_argument("--churn", type=float, default=3.0,
                   help="blocks stored over the stream's history per block held at the end "
                   "(default 3: the stream's retention holds evictions too)")
    p.add_argument("--repeats", type=int, default=3, help="warm starts, median (default 3)")
    p.add_argument("--seed", type=int, default=1)
    add_json_flag(p)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp)) as nats:
        figures = asyncio.run(run(args, nats.url))
    report = Report()
    report.add_figures(figures)
    report.ratio("warm_start_s", "target", figures["warm_start_s"], TARGET_S, better="lower",
                 ndigits=3)
    report.ratio("warm_start", "full_replay", figures["warm_start_s"], figures["full_replay_s"],
                 better="lower", ndigits=3)
    print(f"\nwarm start of a gateway with {figures['indexed_blocks']:,.0f} indexed blocks, "
          f"{args.workers} workers")
    report.print_figures()
    report.print_ratios("the warm start")
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
