"""Benchmark the KV tiers under the torch reference engine: TTFT of a GPU hit, a host hit, a disk
hit, a remote hit and recompute, and each tier's load rate next to the raw device.

One reference engine (torch compute, ``--model-preset kv-heavy`` by default: 128 KiB of KV per
token) writes its pages through its HiCache hook (the kvsidecar backend) into a block store
owner (``python -m shm``) that holds exactly one prompt's pages and has a disk tier and a
remote tier (a local ``redis-server``, every block written through) below it. A
second engine, with a store of its own on the same remote tier, is the other replica.
Each run takes a fresh prompt P and measures, in this order:

* recompute: P's first request (nothing cached anywhere);
* GPU hit: P again (the engine's device cache);
* disk hit: P after short fresh prompts pushed all of P's pages out of the store into the
  disk tier, the tier's files were dropped from the page cache (fsync + POSIX_FADV_DONTNEED)
  and the device cache was flushed (``/flush_cache``);
* host hit: P after another ``/flush_cache`` (the pages the disk hit promoted back into the
  store's shared memory);
* remote hit: P on the second engine, which never saw it: its store loads P's pages from the
  remote tier, where the first store wrote them.

The remote tier's writes are let finish before each measurement, so none competes with it.

The disk hit comes before the host hit on purpose: pages a client has read optimistically
from the store are not evicted in LRU order (see docs/bench/tiers.md), so P is pushed to disk
before anything reads it from the store.

Every request is checked against the engine's ``cached_tokens_details`` (device / storage) and
the store's disk-read counter; a request that did not hit the intended tier aborts the run.
Load rate per tier: the prompt's KV bytes / (tier TTFT - GPU-hit TTFT), i.e. the time the tier
adds over a request whose KV is already on the device. Next to it, measured in the same run:
a memcpy of the same size (host), a sequential read of a file of the same size next to the
disk tier's directory, dropped from the page cache first (disk), and ``redis-benchmark``'s
GET of values of a page's size from the same server (remote).

Prints a table; ``--json FILE`` writes ``{"figures": {...}, "ratios": {...}}``; every ratio
compares with a baseline of this run, oriented so that >= 1 is as good or better:
``<tier>_hit_ttft_vs_recompute`` = recompute TTFT / tier TTFT (host: >= 5 meets the ≤ 0.2 of
recompute target; disk: >= 2.86 meets ≤ 0.35; remote: >= 2 meets ≤ 0.5),
``host_load_gbps_vs_memcpy``, ``disk_load_gbps_vs_seq_read`` and
``remote_load_gbps_vs_redis_benchmark`` (tier rate / raw device rate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import structlog
from bench_engine import Engine, ttft, wait_healthy  # the engine benchmark's helpers
from benchkit import Report, add_json_flag, progress

from kvsidecar.local_redis import RedisServer
from kvsidecar.local_store import StoreProcess
from refengine.presets import ModelConfig
from shm import BlockStoreClient
from shm.tiers.disk_format import HEADER_BYTES as DISK_HEADER_BYTES  # a remote value's header too

PAGE_TOKENS = 16
HEADROOM_PAGES = 8  # store slots beyond one prompt's pages
PUSH_PAGES = 8  # pages per prompt that pushes a prompt's pages out to disk
TIERS = ("gpu", "host", "disk", "remote")
TARGETS = {  # ratio recompute / tier TTFT that meets issue #21's target
    "host": (5.0, ">= 5 (host <= 0.2 of recompute)"),
    "disk": (1 / 0.35, ">= 2.86 (disk <= 0.35 of recompute)"),
    "remote": (2.0, ">= 2 (remote <= 0.5 of recompute)"),
}
SCOPE = "bench-tiers"  # the remote tier's scope (the model id)


class MislabeledRun(RuntimeError):
    """A request did not hit the tier it was meant to measure."""


@dataclass
class Samples:
    ttft: dict[str, list[float]] = field(default_factory=lambda: {t: [] for t in
                                                                  (*TIERS, "recompute")})


def kv_bytes_per_token(preset: str) -> int:
    return ModelConfig(vocab_size=1024).with_preset(preset).kv_bytes_per_token


def drop_page_cache(paths: list[Path]) -> None:
    """Write back and drop these files' pages from the page cache (best effort per file)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # evicted from the tier meanwhile
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_seq_read_gbps(directory: Path, nbytes: int, runs: int) -> float:
    """Sequential read of an ``nbytes`` file in ``directory``, out of the page cache; GB/s."""
    path = directory / f"bench-tiers-raw-{uuid.uuid4().hex[:8]}.bin"
    chunk = 8 << 20
    buf = bytearray(chunk)
    block = np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes()
    try:
        with path.open("wb") as f:
            for off in range(0, nbytes, chunk):
                f.write(block[: min(chunk, nbytes - off)])
        rates = []
        for _ in range(runs):
            drop_page_cache([path])
            view = memoryview(buf)
            t0 = time.perf_counter()
            with path.open("rb", buffering=0) as f:
                while f.readinto(view):
                    pass
            rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
        return statistics.median(rates)
    finally:
        path.unlink(missing_ok=True)


def memcpy_gbps(nbytes: int, runs: int) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)  # both faulted in before timing
    rates = []
    for _ in range(runs):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def redis_benchmark_gbps(port: int, value_bytes: int, requests: int) -> float:
    """``redis-benchmark``'s GET rate of ``value_bytes`` values (SET first, so GETs hit), GB/s."""
    out = subprocess.run(
        ["redis-benchmark", "-p", str(port), "-t", "set,get", "-d", str(value_bytes),
         "-n", str(requests), "-c", "8", "--csv"],
        capture_output=True, text=True, timeout=600, check=True).stdout
    for line in out.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if cells[0] == "GET":
            return float(cells[1]) * value_bytes / 1e9
    raise RuntimeError(f"redis-benchmark printed no GET line: {out!r}")


async def until(done: Callable[[], bool], why: Callable[[], str], timeout_s: float = 120) -> None:
    """Poll ``done`` until it holds; TimeoutError saying ``why()`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(why())
        await asyncio.sleep(0.02)


def details(meta: dict[str, Any]) -> tuple[int, int, int]:
    """(device, host, storage) cached tokens the engine reported; absent: none cached."""
    d = meta.get("cached_tokens_details") or {}
    return int(d.get("device", 0)), int(d.get("host", 0)), int(d.get("storage", 0))


def check(ok: bool, tier: str, what: str, meta: dict[str, Any]) -> None:
    if not ok:
        raise MislabeledRun(
            f"the {tier} request did not hit the {tier} tier ({what}); engine reported "
            f"cached_tokens={meta.get('cached_tokens')} details={meta.get('cached_tokens_details')}"
            " — aborting rather than reporting a mislabeled number"
        )


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.disk_dir = workdir / "disk"
        self.tokens: int = args.prompt_tokens
        self.pages = self.tokens // PAGE_TOKENS
        self.page_bytes = PAGE_TOKENS * kv_bytes_per_token(args.model_preset)
        self.rng = random.Random(args.seed)
        # The store's slots: the owner grants up to a quarter of them to writers ahead of
        # their puts (--grant-fraction 0.25, the default), so one prompt takes 4/3 of its pages.
        self.slots = self.pages * 4 // 3 + HEADROOM_PAGES
        self.socket = workdir / "store.sock"
        self.socket_b = workdir / "store-b.sock"  # the second replica's store
        self.prompt: list[int] = []  # the run's prompt
        self.samples = Samples()
        # P's pages, the pushing prompts' and what promotions evict, a few runs' worth (an
        # LRU past that, as a cache would be configured).
        self.redis = RedisServer(workdir, maxmemory=str(max(256 << 20,
                                                            4 * self.slots * self.page_bytes)))

    def fresh_prompt(self) -> list[int]:
        return [self.rng.randrange(5, 1000) for _ in range(self.tokens)]

    def start_store(self, socket: Path, *tiers: str) -> StoreProcess:
        """An owner holding one prompt and a little headroom, on the remote tier too."""
        return StoreProcess.start(
            self.workdir, owner_id=f"bt{uuid.uuid4().hex[:8]}", socket=socket,
            capacity_bytes=self.slots * self.page_bytes, block_bytes=self.page_bytes,
            args=("--remote-tier-url", self.redis.url, "--remote-scope", SCOPE, *tiers),
            wait_s=60)

    def start_store_a(self) -> StoreProcess:
        """The first replica's store: disk and remote (written through) below it."""
        cap = self.slots * self.page_bytes
        return self.start_store(self.socket, "--disk-tier-dir", str(self.disk_dir),
                                "--disk-tier-capacity-bytes", str(4 * (cap + self.pages * 4096)))

    async def settle(self, store: BlockStoreClient) -> None:
        """Until the remote tier's writes are done."""
        await until(lambda: not store.stats().num_remote_pending,
                    lambda: "the remote tier's writes never finished")

    def start_engine(self, socket: Path) -> Engine:
        hook = {"backend_name": "kvsidecar", "module_path": "adapters.sglang.hicache",
                "class_name": "KvSidecarHiCacheStorage", "interface_v1": 1,
                "socket": str(socket), "model_id": SCOPE}
        return Engine(
            "--model-preset", self.args.model_preset,
            "--page-size", str(PAGE_TOKENS),
            "--max-total-tokens", str(max(8192, 2 * (self.slots + 2) * PAGE_TOKENS)),
            "--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(hook),
            "--hicache-host-pages", str(self.pages),
        )

    async def wait_puts(self, store: BlockStoreClient, target: int, what: str) -> None:
        await until(lambda: store.stats().num_puts >= target,
                    lambda: f"{what}: the store has {store.stats().num_puts} puts, expected "
                    f"{target}")

    async def one_run(self, s: aiohttp.ClientSession, url: str, store: BlockStoreClient,
                      i: int) -> None:
        full = self.tokens - PAGE_TOKENS  # the engine computes at least the last token
        prompt = self.prompt = self.fresh_prompt()
        base = store.stats().num_puts
        t, meta = await ttft(s, url, prompt)
        check(sum(details(meta)) == 0 and not meta.get("cached_tokens"), "recompute",
              "something was cached", meta)
        self.samples.ttft["recompute"].append(t)
        progress(f"run {i}: recompute {t:.3f} s")
        await self.wait_puts(store, base + self.pages - 1, "the prompt's pages written through")
        await self.settle(store)

        t, meta = await ttft(s, url, prompt)
        dev, _, sto = details(meta)
        check(dev >= full and sto == 0, "gpu", f"device {dev} < {full} or storage {sto} > 0",
              meta)
        self.samples.ttft["gpu"].append(t)
        progress(f"run {i}: GPU hit {t:.4f} s ({dev} tokens on device)")

        # Push P out of the store: fresh prompts with a page more than the store's slots in
        # all, PUSH_PAGES at a time, so that the evictions they cause fit the disk tier's
        # staging buffer (a larger burst of evictions drops blocks instead of writing them).
        writes = store.stats().num_disk_writes
        for _ in range(0, self.slots + 1, PUSH_PAGES):
            base = store.stats().num_puts
            push = [self.rng.randrange(5, 1000) for _ in range(PUSH_PAGES * PAGE_TOKENS + 1)]
            await ttft(s, url, push)
            await self.wait_puts(store, base + PUSH_PAGES, "the pushing prompt's pages")
        await until(lambda: store.stats().num_disk_writes >= writes + self.pages - 1,
                    lambda: "the prompt's pages never reached the disk tier")
        await self.settle(store)
        drop_page_cache(sorted(self.disk_dir.glob("*.blk")))
        await self.flush(s, url)
        reads = store.stats().num_disk_reads
        t, meta = await ttft(s, url, prompt)
        dev, _, sto = details(meta)
        read = store.stats().num_disk_reads - reads
        stats = store.stats()
        check(sto >= full and dev == 0, "disk", f"storage {sto} < {full} or device {dev} > 0; "
              f"store: {stats.num_disk_blocks} blocks on disk, {stats.num_disk_dropped} evicted "
              f"blocks dropped (writer behind), {stats.num_disk_errors} errors", meta)
        check(read >= sto // PAGE_TOKENS, "disk",
              f"only {read} of {sto // PAGE_TOKENS} pages were read from disk", meta)
        self.samples.ttft["disk"].append(t)
        progress(f"run {i}: disk hit {t:.4f} s ({read} pages read from disk)")
        await self.flush(s, url)
        reads = store.stats().num_disk_reads
        t, meta = await ttft(s, url, prompt)
        dev, _, sto = details(meta)
        check(sto >= full and dev == 0, "host", f"storage {sto} < {full} or device {dev} > 0",
              meta)
        check(store.stats().num_disk_reads == reads, "host", "the store read from disk", meta)
        self.samples.ttft["host"].append(t)
        progress(f"run {i}: host hit {t:.4f} s ({sto} tokens from the store's memory)")

    async def flush(self, s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url + "/flush_cache") as r:
            if r.status != 200:
                raise RuntimeError(f"/flush_cache answered {r.status}: {await r.text()}")

    async def attach(self, s: aiohttp.ClientSession, url: str, store: BlockStoreClient) -> None:
        """The engine's hook retries the store once a second: one-page prompts until one is
        written through."""
        deadline = time.monotonic() + 60
        warm = 0
        while not store.stats().num_puts:
            if time.monotonic() > deadline:
                raise TimeoutError("the engine's HiCache hook never attached to the store")
            await ttft(s, url, [5 + warm % 900] * (PAGE_TOKENS + 1))
            warm += 1

    async def run(self) -> None:
        self.redis.start()
        stores: list[StoreProcess] = []
        engines: list[Engine] = []
        try:
            stores += [self.start_store_a(), self.start_store(self.socket_b)]
            progress(f"stores up ({self.slots} slots of {self.page_bytes >> 10} KiB, disk tier "
                     f"in {self.disk_dir}, remote tier {self.redis.url}); starting two engines "
                     f"({self.args.model_preset})")
            engines += [self.start_engine(self.socket), self.start_engine(self.socket_b)]
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
                url, url_b = engines[0].urls[0], engines[1].urls[0]
                for u in (url, url_b):
                    await wait_healthy(s, u)
                with BlockStoreClient(str(self.socket)) as store, \
                        BlockStoreClient(str(self.socket_b)) as store_b:
                    for u, st in ((url, store), (url_b, store_b)):
                        await self.attach(s, u, st)
                        await ttft(s, u, self.fresh_prompt())  # torch warm-up, not counted
                    progress("engines attached to their stores, warmed up")
                    for i in range(1, self.args.runs + 1):
                        await self.one_run(s, url, store, i)
                        await self.remote_hit(s, url_b, store, store_b, i)
        finally:
            for eng in engines:
                eng.stop()
            for proc in stores:
                proc.stop()

    async def remote_hit(self, s: aiohttp.ClientSession, url: str, store_a: BlockStoreClient,
                         store_b: BlockStoreClient, i: int) -> None:
        """The run's prompt on the second replica, which loads it from the remote tier (the
        first store evicted it there), once every write is in and both indexes agree."""
        full = self.tokens - PAGE_TOKENS
        await until(lambda: not store_a.stats().num_remote_pending and (
            store_b.stats().num_remote_blocks == store_a.stats().num_remote_blocks),
                    lambda: "the remote tier's writes never settled")
        reads = store_b.stats().num_remote_reads
        t, meta = await ttft(s, url, self.prompt)
        dev, _, sto = details(meta)
        read = store_b.stats().num_remote_reads - reads
        stats = store_a.stats()
        check(sto >= full and dev == 0, "remote", f"storage {sto} < {full} or device {dev} > "
              f"0; first store: {stats.num_remote_writes} written, {stats.num_remote_dropped} "
              f"dropped, {stats.num_remote_errors} errors", meta)
        check(read >= sto // PAGE_TOKENS, "remote",
              f"only {read} of {sto // PAGE_TOKENS} pages were read from the remote tier", meta)
        self.samples.ttft["remote"].append(t)
        progress(f"run {i}: remote hit {t:.4f} s ({read} pages from the remote tier)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench_tiers.py",
        description=(__doc__ or "").split("\n\n")[0].replace("\n", " "),
        epilog="Example: python scripts/bench_tiers.py --json tiers.json   "
        "(a quick check: --quick). Method and figures: docs/bench/tiers.md.",
    )
    add_json_flag(p)
    p.add_argument("--prompt-tokens", type=int, default=4096,
                   help="prompt length in tokens, a multiple of 16 (default: 4096)")
    p.add_argument("--model-preset", default="kv-heavy", choices=["tiny", "kv-heavy"],
                   help="reference engine model size (default: kv-heavy, 128 KiB KV/token)")
    p.add_argument("--runs", type=int, default=5, help="runs per tier; medians (default: 5)")
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"),
                   help="where the disk tier's directory and the raw-read file go: put it on "
                   "the disk to measure (default: /var/tmp)")
    p.add_argument("--seed", type=int, default=0, help="prompt token seed")
    p.add_argument("--quick", action="store_true",
                   help="a fast check: 1,024-token prompts, 1 run")
    args = p.parse_args(argv)
    if args.quick:
        args.prompt_tokens, args.runs = 1024, 1
    if args.prompt_tokens < 2 * PAGE_TOKENS or args.prompt_tokens % PAGE_TOKENS:
        p.error(f"--prompt-tokens must be a multiple of {PAGE_TOKENS}, at least {2 * PAGE_TOKENS}")
    if args.runs < 1:
        p.error("--runs must be at least 1")
    if not args.dir.is_dir():
        p.error(f"--dir {args.dir} is not a directory")

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    workdir = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=args.dir))
    bench = Bench(args, workdir)
    nbytes = bench.pages * bench.page_bytes
    try:
        try:
            asyncio.run(bench.run())
        except MislabeledRun as exc:
            print(f"bench_tiers: {exc}", file=sys.stderr)
            return 2
        progress(f"raw devices: sequential read and memcpy of {nbytes / 2**20:.0f} MiB, "
                 "redis-benchmark GET of pages")
        seq_read = raw_seq_read_gbps(workdir, nbytes, 3)
        memcpy = memcpy_gbps(nbytes, 3)
        redis_get = redis_benchmark_gbps(bench.redis.port, bench.page_bytes + DISK_HEADER_BYTES,
                                         max(64, min(2000, 4 * bench.pages)))
    finally:
        bench.redis.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in bench.samples.ttft.items()}
    report = Report()
    report.add_figures({
        "prompt_tokens": args.prompt_tokens,
        "prompt_kv_bytes": nbytes,
        "runs": args.runs,
        "recompute_ttft_s": med["recompute"],
    })
    for tier in TIERS:
        report.figure(f"{tier}_hit_ttft_s", med[tier])
    raw = {"host": ("memcpy", memcpy), "disk": ("seq_read", seq_read),
           "remote": ("redis_benchmark", redis_get)}
    report.figure("memcpy_gbps", memcpy)
    report.figure("disk_seq_read_gbps", seq_read)
    report.figure("redis_benchmark_get_gbps", redis_get)
    ratios = {tier: report.ratio(f"{tier}_hit_ttft", "recompute", med[tier], med["recompute"],
                                 better="lower") for tier in TIERS}
    loads: dict[str, float] = {}
    for tier in ("host", "disk", "remote"):
        added = med[tier] - med["gpu"]
        if added > 0:  # else the load is within the noise of a GPU hit: no rate to report
            loads[tier] = report.figure(f"{tier}_load_gbps", nbytes / added / 1e9)
            name, rate = raw[tier]
            report.ratio(f"{tier}_load_gbps", name, loads[tier], rate, better="higher")

    print(f"\n{args.model_preset} preset, {args.prompt_tokens}-token prompt "
          f"({nbytes / 2**20:.0f} MiB of KV), median of {args.runs} runs\n")
    print(f"{'tier':<10}{'TTFT s':>10}{'of recompute':>14}{'recompute/tier':>16}  "
          f"{'target':<38}{'load GB/s':>10}  raw device GB/s")
    raw_text = {"host": f"{memcpy:.2f} (memcpy)", "disk": f"{seq_read:.2f} (seq. read, cold)",
                "remote": f"{redis_get:.2f} (redis-benchmark GET)"}
    for tier in TIERS:
        ratio = ratios[tier]
        goal, text = TARGETS.get(tier, (0.0, ""))
        verdict = ("" if not text else " met" if ratio >= goal else " MISSED")
        load = loads.get(tier)
        rate_text = "-" if tier == "gpu" else "in noise" if load is None else f"{load:.2f}"
        print(f"{tier + ' hit':<10}{med[tier]:>10.4f}{med[tier] / med['recompute']:>14.3f}"
              f"{ratio:>16.2f}  {text + verdict:<38}{rate_text:>10}  {raw_text.get(tier, '-')}")
    print(f"{'recompute':<10}{med['recompute']:>10.4f}{1.0:>14.3f}{1.0:>16.2f}")
    print("\nload GB/s = prompt KV bytes / (tier TTFT - GPU-hit TTFT)")
    report.print_ratios("the tier")
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
