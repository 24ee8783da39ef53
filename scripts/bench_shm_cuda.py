#!/usr/bin/env python3
"""Benchmark the shared-memory block store with CUDA tensors (needs a CUDA GPU and torch).

An engine offloads KV blocks from GPU memory to its sidecar's host store and loads them back
on a prefix hit. This starts a real owner (``python -m shm``) and, from this process, for
256 KiB and 2 MiB blocks in batches of 64, measures:

* put: ``put_many`` of CUDA tensors (device → the mapped segment) and get: ``get_many`` into
  CUDA tensors (segment → device), with registration off (``register_cuda=False``: pageable
  host memory, one synchronous copy per block);
* the same with the client as it ships: it registers its mapping with CUDA
  (``cudaHostRegister``) on the first GPU tensor, so the copies DMA straight to and from the
  segment, queued without waiting, one wait per batch (``shm.client._cuda``);
* the baseline, in the same run: the same per-block copies between the GPU and a pinned host
  buffer of this process (``Tensor.copy_``), the fastest a host tier can move them.

Every get is checked byte for byte against what was put. Ratios (>= 1: as fast as the
pinned-buffer copies) are ``<op>_<mapping>_<size>_gbps_vs_pinned``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchkit import Report, add_json_flag

from kvsidecar.local_store import StoreProcess

SIZES = {"256KiB": 256 << 10, "2MiB": 2 << 20}
BATCH = 64


def _torch():  # type: ignore[no-untyped-def]
    try:
        import torch
    except ImportError:
        sys.exit("bench_shm_cuda needs torch: pip install torch==2.13.0 (CUDA build on a GPU)")
    if not torch.cuda.is_available():
        sys.exit("bench_shm_cuda needs a CUDA GPU; torch sees none here")
    return torch


def _median_s(torch, fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])  # the first rounds warm up


def _put_get(torch, client, src, dst, counter, reps):  # type: ignore[no-untyped-def]
    """Median seconds of put_many of ``src`` and of get_many of it back into ``dst``."""
    keys: list[tuple[int, int]] = []

    def put() -> None:
        keys[:] = [(3, next(counter)) for _ in range(BATCH)]
        assert client.put_many(keys, src) == [True] * BATCH

    def get() -> None:
        assert client.get_many(keys, dst) == [True] * BATCH

    return _median_s(torch, put, reps), _median_s(torch, get, reps), keys


def bench_size(torch, tmp: Path, label: str, block_bytes: int, reps: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    from shm import BlockStoreClient

    fig: dict[str, float] = {}
    with StoreProcess.start(tmp, owner_id=f"cuda{os.getpid()}-{label}",
                            socket=tmp / f"{label}.sock", block_bytes=block_bytes,
                            capacity_bytes=block_bytes * BATCH):
        gen = torch.Generator(device="cuda").manual_seed(0)
        src = [torch.randint(0, 256, (block_bytes,), dtype=torch.uint8, device="cuda",
                             generator=gen) for _ in range(BATCH)]
        dst = [torch.zeros(block_bytes, dtype=torch.uint8, device="cuda") for _ in range(BATCH)]
        pinned = [torch.empty(block_bytes, dtype=torch.uint8, pin_memory=True)
                  for _ in range(BATCH)]

        def d2h() -> None:
            for s, p in zip(src, pinned, strict=True):
                p.copy_(s)

        def h2d() -> None:
            for p, d in zip(pinned, dst, strict=True):
                d.copy_(p)

        nbytes = BATCH * block_bytes
        for name, fn in (("pinned_d2h", d2h), ("pinned_h2d", h2d)):
            fig[f"{name}_{label}_gbps"] = nbytes / _median_s(torch, fn, reps) / 1e9
        counter = iter(range(1, 1 << 62))
        for mapping in ("pageable", "registered"):
            with BlockStoreClient(tmp / f"{label}.sock",
                                  register_cuda=mapping == "registered") as client:
                put_s, get_s, keys = _put_get(torch, client, src, dst, counter, reps)
                fig[f"put_{mapping}_{label}_gbps"] = nbytes / put_s / 1e9
                fig[f"get_{mapping}_{label}_gbps"] = nbytes / get_s / 1e9
                for d in dst:
                    d.zero_()
                assert client.get_many(keys, dst) == [True] * BATCH
                if not all(torch.equal(s, d) for s, d in zip(src, dst, strict=True)):
                    raise RuntimeError(f"get returned other bytes than were put ({mapping})")
                # a client that leases (another process's view): the same bytes
                with BlockStoreClient(tmp / f"{label}.sock", optimistic_reads=False,
                                      register_cuda=mapping == "registered") as leasing:
                    for d in dst:
                        d.zero_()
                    assert leasing.get_many(keys, dst) == [True] * BATCH
                    if not all(torch.equal(s, d) for s, d in zip(src, dst, strict=True)):
                        raise RuntimeError(f"a leased get returned other bytes ({mapping})")
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_json_flag(p)
    p.add_argument("--reps", type=int, default=30, help="timed batches per figure (default 30)")
    args = p.parse_args(argv)
    torch = _torch()
    report = Report()
    with tempfile.TemporaryDirectory(prefix="kvs-cuda-") as tmp:
        for label, block_bytes in SIZES.items():
            report.add_figures(bench_size(torch, Path(tmp), label, block_bytes, args.reps))
    fig = report.figures
    print(f"# {torch.cuda.get_device_name()}; {BATCH} blocks per batch; GB/s")
    print(f"{'block':>7} {'mapping':>10} {'put':>8} {'get':>8} {'put/pinned':>11} "
          f"{'get/pinned':>11}")
    for label in SIZES:
        d2h, h2d = fig[f"pinned_d2h_{label}_gbps"], fig[f"pinned_h2d_{label}_gbps"]
        print(f"{label:>7} {'pinned':>10} {d2h:8.2f} {h2d:8.2f}")
        for mapping in ("pageable", "registered"):
            if f"put_{mapping}_{label}_gbps" not in fig:
                continue
            put, get = fig[f"put_{mapping}_{label}_gbps"], fig[f"get_{mapping}_{label}_gbps"]
            put_ratio = report.ratio(f"put_{mapping}_{label}_gbps", "pinned", put, d2h,
                                     better="higher")
            get_ratio = report.ratio(f"get_{mapping}_{label}_gbps", "pinned", get, h2d,
                                     better="higher")
            print(f"{label:>7} {mapping:>10} {put:8.2f} {get:8.2f} {put_ratio:11.2f} "
                  f"{get_ratio:11.2f}")
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
