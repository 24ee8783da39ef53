#!/usr/bin/env python3
"""Benchmark the shared-memory block store from a second process, next to memcpy.

For each block size (16 KiB, 256 KiB, 2 MiB, 16 MiB) this starts a real owner
(``python -m shm``) and, from this process, measures:

* put: ``put_many`` of a batch of fresh keys chained parent → child, as one request's
  blocks are (one stored event per batch; each put evicts the oldest batch, one removed
  event);
* get: ``get_many`` of that batch into warm arrays (the client knows where it put the
  blocks, so it copies out through the segment's read index without asking the owner; see
  ``shm.read_index``);
* memcpy: ``numpy.copyto`` of the same batch between the same warm private arrays, one
  block-sized copy per block as put and get make, in one thread: the baseline every copy
  ratio compares with (all arrays are page-aligned, see ``_aligned``);

the three interleaved round by round, so noise from other work on the host hits all alike,
in an order that rotates (put get memcpy, memcpy put get, put memcpy get): each copy reads
one buffer and writes another, and whichever ran just before decides which of them is still
in the cache (a 16 MiB batch is half the L3), so a fixed order would favour one of them.

Each size runs twice, with two store sizes:

* a store of one batch: each put reserves (one round trip), then overwrites the slots of
  the batch before, which the last round's get read: its copy lands in memory as warm as
  memcpy's, so the ratio measures what the store adds to the copy (the issue's target);
* a store of ``--store-batches`` batches (default 4), as a store larger than the cache is:
  each put copies into slots the owner granted it ahead while its claim of them is on the
  way (no round trip first; see ``BlockStoreClient.begin_put``), slots no copy has touched
  for rounds. A fourth copy runs in each round there, ``memcpy_cold``: the same batch into
  one of as many sets of private arrays as the store has batches, in turn, so its
  destination is as cold as the put's; put and get are compared with it too.

Batches of 1 and 64 blocks (16 MiB blocks: as many as four batches in ``--max-segment-mib``
allow), as GB/s and blocks/s, per-batch medians. It also measures control round trips (an
empty ``Ping``, a ``Contains`` of 64 keys, a ``Lease`` of 64 keys plus its ``Release``; a
second, idle client stays attached, as in a deployment) against a Unix-socket echo server
on uvloop with the same framing, in the same run, with the servers on this process's CPU
and on another one (a VM pays tens of µs per cross-CPU wake-up, so where the scheduler puts
a server otherwise decides the figure).

Ratios are oriented so that >= 1 means we are as good as the baseline or better.
With ``--pin-cpu N`` every process of the run shares one CPU (see ``--help``).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from benchkit import ROOT, Report, add_json_flag

from kvsidecar.local_store import StoreProcess
from shm import BlockStoreClient
from shm.protocol import Contains, Done, Flags, Lease, Ping, Release, Slots

SIZES = {"16KiB": 16 << 10, "256KiB": 256 << 10, "2MiB": 2 << 20, "16MiB": 16 << 20}
BATCHES = (1, 64)

_ECHO_SERVER = r"""
import asyncio, os, sys, uvloop
class Echo(asyncio.Protocol):
    def connection_made(self, t): self.t = t
    def data_received(self, d): self.t.write(d)
async def main():
    path = sys.argv[1]
    server = await asyncio.get_running_loop().create_unix_server(Echo, path=path)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    server.close()
uvloop.run(main())
"""


# put_256KiB_b64_gbps, memcpy_cold_2MiB_b64_store4_gbps, ...
_COPY_FIGURE = re.compile(r"^(put|get|memcpy_cold|memcpy)_(\w+?)_b(\d+)(?:_store(\d+))?_gbps$")
ORDERS = (("put", "get", "memcpy"), ("memcpy", "put", "get"), ("put", "memcpy", "get"))
OWNER_ARGS: list[str] = []  # extra owner options (--owner-sched-batch, --grant-fraction)


def _start_owner(tmp: Path, name: str, block_bytes: int, num_slots: int) -> StoreProcess:
    """A real owner (``python -m shm``) of this checkout, its socket ``<tmp>/<name>.sock``."""
    return StoreProcess.start(tmp, owner_id=f"bench{os.getpid()}-{name}",
                              socket=tmp / f"{name}.sock", block_bytes=block_bytes,
                              capacity_bytes=block_bytes * num_slots, args=OWNER_ARGS,
                              env={"PYTHONPATH": str(ROOT)})


def _aligned(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array, as engines' buffers are (torch aligns CPU tensors to 64
    bytes, pinned buffers to pages). numpy's malloc puts a 256 KiB array 16 bytes past a
    page: two such arrays copy with mutually aligned loads and stores, but a copy between
    one and a 512-byte-aligned slot does not, which would slow only our side."""
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start : start + nbytes]


def bench_size(tmp: Path, label: str, block_bytes: int, max_segment: int,
               budget_s: float, store_batches: int) -> dict[str, float]:
    """put, get and memcpy of one block size, interleaved so all three see the same noise."""
    batch_max = min(64, max_segment // block_bytes // 4)
    name = label if store_batches == 1 else f"{label}-store{store_batches}"
    fig: dict[str, float] = {}
    owner = _start_owner(tmp, name, block_bytes, store_batches * batch_max)
    rng = np.random.default_rng(0)
    try:
        with BlockStoreClient(tmp / f"{name}.sock") as client:
            srcs = [_aligned(block_bytes) for _ in range(batch_max)]
            for arr in srcs:
                arr[:] = rng.integers(0, 256, block_bytes, dtype=np.uint8)
            dsts = [_aligned(block_bytes) for _ in range(batch_max)]
            cold_sets = [[_aligned(block_bytes) for _ in range(batch_max)]
                         for _ in range(store_batches if store_batches > 1 else 0)]
            for arr in [*dsts, *(a for arrays in cold_sets for a in arrays)]:
                arr.fill(1)
            counter = iter(range(1, 1 << 62))
            for batch in sorted({1, batch_max}):
                src, dst = srcs[:batch], dsts[:batch]
                ops = ("put", "get", "memcpy", *(("memcpy_cold",) if cold_sets else ()))
                times: dict[str, list[float]] = {op: [] for op in ops}
                deadline = time.perf_counter() + budget_s
                rep = 0
                while rep < 9 or time.perf_counter() < deadline:
                    # A batch is one request's chain of blocks: each block's parent is the
                    # previous one, so the owner records one BlockStored event per batch.
                    hashes = [next(counter) for _ in range(batch)]
                    keys = [(7, h) for h in hashes]
                    parents = [hashes[0] - 1, *hashes[:-1]]
                    took: dict[str, float] = {}
                    hits: list[bool] = []
                    if rep == 0:  # so that the byte check below sees what get wrote
                        for d in dst:
                            d.fill(1)
                    order = ORDERS[rep % len(ORDERS)] + ops[3:]  # memcpy_cold: its own set
                    for op in order:
                        t0 = time.perf_counter()
                        if op == "put":
                            client.put_many(keys, src, parent_hashes=parents)
                        elif op == "get":
                            hits = client.get_many(keys, dst)
                        elif op == "memcpy":
                            for s, d in zip(src, dst, strict=True):
                                np.copyto(d, s)
                        else:
                            for s, d in zip(src, cold_sets[rep % len(cold_sets)], strict=False):
                                np.copyto(d, s)
                        took[op] = time.perf_counter() - t0
                        if op == "get" and rep == 0 and not all(  # round 0: get before memcpy
                            np.array_equal(s, d) for s, d in zip(src, dst, strict=True)
                        ):
                            raise RuntimeError("get returned different bytes than were put")
                    if not all(hits):
                        raise RuntimeError("a block just put was missing")
                    if rep >= len(ORDERS) + store_batches:  # the first rounds warm up
                        for op, seconds in took.items():
                            times[op].append(seconds)
                    rep += 1
                    if rep >= 20_000:
                        break
                tag = f"{label}_b{batch}" + ("" if store_batches == 1 else
                                             f"_store{store_batches}")
                for op, samples in times.items():
                    t = statistics.median(samples)
                    fig[f"{op}_{tag}_gbps"] = batch * block_bytes / t / 1e9
                    fig[f"{op}_{tag}_blocks_per_s"] = batch / t
    finally:
        owner.stop()
    return fig


def bench_rtt(tmp: Path, reps: int, cpus: tuple[int, int] | None) -> dict[str, float]:
    """Control round trips next to a uvloop Unix-socket echo, interleaved round by round.

    ``cpus``: (this process's CPU, the servers' CPU), or None to leave placement to the
    scheduler. Echo server and owner always share a placement, so the ratio is fair.
    """
    echo_path = tmp / "echo.sock"
    echo = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER, str(echo_path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert echo.stdout is not None and echo.stdin is not None
    owner = None
    before = os.sched_getaffinity(0)
    try:
        if echo.stdout.readline().strip() != "ready":
            raise RuntimeError("echo server did not start")
        owner = _start_owner(tmp, "rtt", 4096, 256)
        if cpus is not None:
            os.sched_setaffinity(0, {cpus[0]})
            for pid in (echo.pid, owner.proc.pid):
                os.sched_setaffinity(pid, {cpus[1]})
        # A second, idle client, as in a deployment (the sidecar and an engine): with more
        # than one connection the owner queues each request for one loop turn behind the
        # one-way frames other connections have sent (see shm.owner.server).
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock, \
                BlockStoreClient(tmp / "rtt.sock") as client, \
                BlockStoreClient(tmp / "rtt.sock") as _idle:
            sock.connect(str(echo_path))
            frame = struct.pack("<I", 8) + bytes(8)

            def echo_once() -> None:
                sock.sendall(frame)
                got = 0
                while got < len(frame):
                    got += len(sock.recv(4096))

            keys = [(9, i) for i in range(64)]
            client.put_many(keys, [np.zeros(4096, np.uint8)] * 64)
            nss, hashes = [k[0] for k in keys], [k[1] for k in keys]
            call = client._call  # the bare round trip, without array checks or copies

            def lease64() -> None:
                reply = call(Lease(nss, hashes), Slots)
                client._send_only(Release(reply.slots, reply.generations))  # type: ignore[arg-type]

            probes: dict[str, Callable[[], object]] = {
                "echo": echo_once,
                "ping": lambda: call(Ping(), Done),
                "contains64": lambda: call(Contains(nss, hashes), Flags),
                "lease64": lease64,
            }
            samples: dict[str, list[float]] = {name: [] for name in probes}
            for rep in range(reps + 100):
                for name, probe in probes.items():
                    probe()  # untimed: the first call after switching servers runs cold
                    start = time.perf_counter_ns()
                    probe()
                    if rep >= 100:  # warm-up rounds are not counted
                        samples[name].append((time.perf_counter_ns() - start) / 1000)
    finally:
        os.sched_setaffinity(0, before)
        echo.stdin.close()
        echo.wait(timeout=30)
        if owner is not None:
            owner.stop()
    fig: dict[str, float] = {}
    for name, values in samples.items():
        values.sort()
        fig[f"rtt_{name}_us_p50"] = values[len(values) // 2]
        fig[f"rtt_{name}_us_p99"] = values[int(len(values) * 0.99)]
    return fig


def add_ratios(report: Report) -> None:
    """Each put and get rate against memcpy's (and the cold memcpy's) of the same batch, and
    each round trip against the echo server's, in the same placement."""
    fig = report.figures
    for key, value in list(fig.items()):
        for op in ("put", "get"):
            if key.startswith(f"{op}_") and key.endswith("_gbps"):
                rest = key.removeprefix(f"{op}_")
                report.ratio(key, "memcpy", value, fig[f"memcpy_{rest}"], better="higher")
                if f"memcpy_cold_{rest}" in fig:
                    report.ratio(key, "memcpy_cold", value, fig[f"memcpy_cold_{rest}"],
                                 better="higher")
    for place in ("same_cpu", "cross_cpu", "pinned"):
        if f"rtt_{place}_echo_us_p50" not in fig:
            continue
        for name in ("ping", "contains64", "lease64"):
            report.ratio(f"rtt_{place}_{name}_us_p50", "echo", fig[f"rtt_{place}_{name}_us_p50"],
                         fig[f"rtt_{place}_echo_us_p50"], better="lower")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_json_flag(parser)
    parser.add_argument("--max-segment-mib", type=int, default=1024,
                        help="largest segment to create (default 1024; with four batches "
                             "per store it caps the 16 MiB batch at 16 blocks)")
    parser.add_argument("--store-batches", type=int, default=4,
                        help="batches the larger store of each size holds (default 4; 1 "
                             "skips it): its puts copy into slots granted ahead, which no "
                             "copy has touched for rounds, and are also compared with a "
                             "memcpy into as cold memory")
    parser.add_argument("--grant-fraction", type=float, default=None,
                        help="the owners' --grant-fraction (default: theirs, 0.25)")
    parser.add_argument("--budget-s", type=float, default=0.6,
                        help="seconds of interleaved put/get/memcpy rounds per block size "
                             "and batch (default 0.6)")
    parser.add_argument("--rtt-reps", type=int, default=5000,
                        help="round trips per latency measurement (default 5000)")
    parser.add_argument("--pin-cpu", type=int, default=None, metavar="N",
                        help="run this process, the owners and the echo server on CPU N "
                             "(the protocol is synchronous, so they never need to run at "
                             "once; this avoids cross-CPU wake-ups, costly in VMs)")
    parser.add_argument("--owner-sched-batch", action="store_true",
                        help="run the owners under SCHED_BATCH (python -m shm --sched-batch)")
    args = parser.parse_args(argv)
    if args.owner_sched_batch:
        OWNER_ARGS.append("--sched-batch")
    if args.grant_fraction is not None:
        OWNER_ARGS.extend(["--grant-fraction", str(args.grant_fraction)])
    if args.store_batches < 1:
        parser.error("--store-batches must be at least 1")
    if args.pin_cpu is not None:
        os.sched_setaffinity(0, {args.pin_cpu})  # children inherit it

    fig: dict[str, float] = {}
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-shm-") as tmp_name:
        tmp = Path(tmp_name)
        for label, size in SIZES.items():
            for batches in sorted({1, args.store_batches}):
                fig |= bench_size(tmp, label, size, args.max_segment_mib << 20,
                                  args.budget_s, batches)
        cpus = sorted(os.sched_getaffinity(0))
        if args.pin_cpu is None and len(cpus) >= 2:
            # The scheduler may put a server on our CPU or on another, and in a VM a
            # cross-CPU wake-up costs tens of µs: measure both placements explicitly.
            for place, pair in (("same_cpu", (cpus[0], cpus[0])),
                                ("cross_cpu", (cpus[0], cpus[1]))):
                rtt = bench_rtt(tmp, args.rtt_reps, pair)
                fig |= {k.replace("rtt_", f"rtt_{place}_", 1): v for k, v in rtt.items()}
        else:
            fig |= {k.replace("rtt_", "rtt_pinned_", 1): v
                    for k, v in bench_rtt(tmp, args.rtt_reps, None).items()}
    report = Report()
    report.add_figures(fig)
    add_ratios(report)
    rat = report.ratios
    print(f"# {os.cpu_count()} CPUs; load average (1 min) {load_start:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end; other work on the host skews every figure")

    print(f"{'block':>7} {'batch':>5} {'store':>6} {'op':>11} {'GB/s':>8} {'blocks/s':>11} "
          f"{'vs memcpy':>9} {'vs cold':>8}")
    for key in fig:
        parsed = _COPY_FIGURE.match(key)
        if parsed is None:
            continue
        op, label, batch, store = parsed.groups()
        vs = rat.get(f"{key}_vs_memcpy")
        cold = rat.get(f"{key}_vs_memcpy_cold")
        print(f"{label:>7} {batch:>5} {store or '1':>6} {op:>11} {fig[key]:8.2f} "
              f"{fig[key.replace('_gbps', '_blocks_per_s')]:11.0f} "
              f"{'' if vs is None else f'{vs:9.2f}'} {'' if cold is None else f'{cold:8.2f}'}")
    print()
    print(f"{'placement':>10} {'round trip':>12} {'p50 µs':>8} {'p99 µs':>8} {'echo/ours':>9}")
    for place in ("same_cpu", "cross_cpu", "pinned"):
        for name in ("echo", "ping", "contains64", "lease64"):
            key = f"rtt_{place}_{name}_us"
            if f"{key}_p50" not in fig:
                continue
            vs = rat.get(f"{key}_p50_vs_echo")
            print(f"{place:>10} {name:>12} {fig[f'{key}_p50']:8.1f} {fig[f'{key}_p99']:8.1f} "
                  f"{'' if vs is None else f'{vs:9.2f}'}")
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
