#!/usr/bin/env python3
"""Benchmark sidecar-to-sidecar block import over shm, NIXL and TCP, next to raw baselines.

An exporter sidecar runs as its own process (``python -m sidecar.transfer``) holding
``--batch`` blocks of ``--block-mib`` MiB; this process is the importer (a block store
owner with its ``BlockTransferService`` on uvloop). Each round, interleaved so that noise
from other work on the host hits all alike, it measures one batch:

* shm / nixl / tcp: ``service.pull(...)`` end to end: reserve, export request over HTTP,
  the copy, the lease confirmation, the commit (the batch is removed again between rounds);
* memcpy: a single-thread numpy copy of the same slots from the exporter's segment (mapped
  read-only here) into reserved slots of ours, the shm path's baseline;
* raw NIXL: a NIXL READ of the same slots between the same two agents (the same two
  processes), with no HTTP, lease or reservation around it, the nixl path's baseline;
* raw socket: the same bytes over a loopback TCP connection from a plain sender process
  (blocking ``sendall`` / ``recv_into``), the tcp path's baseline.

Per transport it prints GB/s (from the median batch), p50 and p99 batch times, and the time
to move the KV of 1,000 tokens for the reference engine's presets. Ratios compare each path
with its baseline, oriented so that >= 1 means as good as the baseline or better.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import numpy as np
import uvloop
from benchkit import ROOT, Report, add_json_flag, progress

from kvsidecar.local_store import StoreProcess
from refengine.presets import PRESETS, ModelConfig
from shm import BlockStoreClient, BlockStoreOwner, OwnerConfig
from shm.client.readonly import ReadOnlySegment
from shm.owner.local import LocalSession
from sidecar.transfer import BlockTransferService, TransferConfig, Transport
from sidecar.transfer.messages import ExportRequest
from sidecar.transfer.peer import PeerClient

_SENDER = r"""
import socket, sys, numpy as np
total = int(sys.argv[1])
buf = np.full(total, 7, dtype=np.uint8)
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
while conn.recv(1):
    conn.sendall(memoryview(buf))
"""


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _start_exporter(tmp: Path, batch: int, block_bytes: int) -> StoreProcess:
    """The exporter: a block peer of this checkout (``python -m sidecar.transfer``)."""
    return StoreProcess.start(tmp, peer=True, socket=tmp / "exporter.sock",
                              block_bytes=block_bytes, capacity_bytes=(batch + 2) * block_bytes,
                              env={"PYTHONPATH": str(ROOT)})


class Bench:
    def __init__(self, args: argparse.Namespace, exporter: StoreProcess,
                 service: BlockTransferService, owner: BlockStoreOwner,
                 session: aiohttp.ClientSession) -> None:
        self.args = args
        self.block_bytes = args.block_mib << 20
        self.exporter = exporter
        self.service = service
        self.owner = owner
        self.peers = PeerClient(session)
        self.keys = [(99, i) for i in range(args.batch)]
        self.times: dict[str, list[float]] = {}

    async def timed(self, name: str, fn: Callable[[], Awaitable[object]]) -> None:
        start = time.perf_counter()
        await fn()
        self.times.setdefault(name, []).append(time.perf_counter() - start)

    async def run(self, transports: list[Transport]) -> None:
        url = self.exporter.url or ""
        nixl = Transport.NIXL in transports
        if nixl:
            await self.service.nixl_endpoint()
        # Baseline state: the exporter's slots of the batch (held by one long export), and
        # scratch slots of ours to copy into (reserved, never committed).
        offer = await self.peers.export(url, ExportRequest(
            self.keys, Transport.NIXL if nixl else Transport.TCP, self.block_bytes, "uint8",
            ttl_s=600), 30)
        scratch = LocalSession(self.owner)
        reply = scratch.reserve([(98, i) for i in range(len(self.keys))])
        dst = [s for s in reply.slots if s is not None]
        src_segment = ReadOnlySegment.attach(self.exporter.segment)
        sender = subprocess.Popen([sys.executable, "-c", _SENDER,
                                   str(len(self.keys) * self.block_bytes)],
                                  stdout=subprocess.PIPE, text=True)
        assert sender.stdout is not None
        raw = socket.create_connection(("127.0.0.1", int(sender.stdout.readline())))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        rows = scratch.rows
        views = [memoryview(rows[s]) for s in dst]  # type: ignore[arg-type]

        def memcpy() -> None:
            for s, d in zip(offer.slots, dst, strict=True):
                rows[d] = src_segment.rows[s]

        def socket_copy() -> None:
            raw.sendall(b"g")
            for view in views:
                got = 0
                while got < len(view):
                    got += raw.recv_into(view[got:])

        async def in_thread(fn: Callable[[], None]) -> None:
            await asyncio.to_thread(fn)

        try:
            for round_ in range(self.args.warmup + self.args.rounds):
                if round_ == self.args.warmup:
                    self.times.clear()
                for transport in transports:
                    await self.timed(transport.value, lambda t=transport: self.service.pull(
                        url, self.keys, transport=t))
                    scratch.remove(self.keys)
                await self.timed("memcpy", lambda: in_thread(memcpy))
                if nixl:
                    endpoint = await self.service.nixl_endpoint()
                    agent = offer.nixl_agent or ""
                    await self.timed("raw_nixl", lambda e=endpoint, a=agent: e.read(
                        a, offer.slots, dst, 30))
                await self.timed("raw_socket", lambda: in_thread(socket_copy))
        finally:
            raw.close()
            sender.wait(10)
            scratch.close()
            src_segment.close()
            await self.peers.release(url, offer.export_id, 30)


def _report(bench: Bench, transports: list[Transport], json_path: Path | None) -> None:
    batch_bytes = len(bench.keys) * bench.block_bytes
    presets = {name: ModelConfig(vocab_size=1024, **fields).kv_bytes_per_token
               for name, fields in PRESETS.items()}
    names = [t.value for t in transports] + [n for n in ("memcpy", "raw_nixl", "raw_socket")
                                             if n in bench.times]
    report = Report()
    head = "| path | GB/s | p50 ms | p99 ms | " + " | ".join(
        f"ms / 1k tokens ({p}, {b // 1024} KiB/token)" for p, b in presets.items()) + " |"
    print(f"\n{len(bench.keys)} × {bench.block_bytes >> 20} MiB blocks per batch, "
          f"{bench.args.rounds} rounds\n")
    print(head)
    print("|" + "---|" * (4 + len(presets)))
    for name in names:
        times = bench.times[name]
        p50, p99 = statistics.median(times), _percentile(times, 0.99)
        gbps = batch_bytes / p50 / 1e9
        report.figure(f"{name}_gbps", gbps)
        report.figure(f"{name}_p50_ms", p50 * 1e3)
        report.figure(f"{name}_p99_ms", p99 * 1e3)
        per_k = []
        for preset, per_token in presets.items():
            ms = 1000 * per_token / (gbps * 1e9) * 1e3
            report.figure(f"{name}_ms_per_1k_tokens_{preset.replace('-', '_')}", ms)
            per_k.append(f"{ms:.3f}")
        print(f"| {name} | {gbps:.2f} | {p50 * 1e3:.1f} | {p99 * 1e3:.1f} | "
              + " | ".join(per_k) + " |")
    fig = report.figures
    targets = {}
    for path, base, target in (("shm", "memcpy", 0.8), ("nixl", "raw_nixl", 0.9),
                               ("tcp", "raw_socket", 0.7)):
        if f"{path}_gbps" in fig and f"{base}_gbps" in fig:
            report.ratio(f"{path}_gbps", base, fig[f"{path}_gbps"], fig[f"{base}_gbps"],
                         better="higher")
            targets[f"{path}_gbps_vs_{base}"] = f"target >= {target}"
    report.print_ratios("the path", notes=targets)
    if json_path:
        report.write_json(json_path)


async def _main(args: argparse.Namespace, transports: list[Transport]) -> None:
    block_bytes = args.block_mib << 20
    tmp = Path(tempfile.mkdtemp(prefix="kvb-"))
    exporter = _start_exporter(tmp, args.batch, block_bytes)
    try:
        keys = [(99, i) for i in range(args.batch)]
        rng = np.random.default_rng(0)
        with BlockStoreClient(exporter.socket) as store:
            store.put_many(keys, [rng.integers(0, 256, block_bytes, dtype=np.uint8)
                                  for _ in keys])
        cfg = OwnerConfig(owner_id=f"bi{uuid.uuid4().hex[:8]}",
                          socket_path=tmp / "importer.sock",
                          capacity_bytes=3 * args.batch * block_bytes, block_bytes=block_bytes)
        async with (
            BlockStoreOwner(cfg) as owner,
            aiohttp.ClientSession() as session,
            BlockTransferService(owner, session, TransferConfig()) as service,
        ):
            bench = Bench(args, exporter, service, owner, session)
            await bench.run(transports)
        _report(bench, transports, args.json)
    finally:
        exporter.stop()
        for path in tmp.iterdir():
            path.unlink()
        tmp.rmdir()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--block-mib", type=int, default=2, help="MiB per block (default 2)")
    parser.add_argument("--batch", type=int, default=32, help="blocks per pull (default 32)")
    parser.add_argument("--rounds", type=int, default=30, help="measured rounds (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured rounds first")
    parser.add_argument("--transports", default="shm,nixl,tcp",
                        help="comma-separated subset of shm,nixl,tcp (nixl needs the extra)")
    add_json_flag(parser)
    args = parser.parse_args()
    if 3 * args.batch * args.block_mib > 256:
        parser.error("the importer's segment (3 × batch × block) must stay <= 256 MiB")
    transports = [Transport(t) for t in args.transports.split(",") if t]
    if Transport.NIXL in transports:
        try:
            import nixl_cu12  # noqa: F401
        except ImportError:
            progress("nixl is not installed (the 'nixl' extra): skipping it")
            transports.remove(Transport.NIXL)
    uvloop.run(_main(args, transports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
