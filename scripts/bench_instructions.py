#!/usr/bin/env python3
"""Benchmark the gateway's CPU instructions per request under callgrind, against another
commit of ours: the check that a refactor costs the hot path nothing (issue #29: at most 3 %).

For this checkout and for ``--baseline REV`` (checked out into a temporary git worktree),
each on a fresh stack of ``--workers`` simulated reference engines with their sidecars (this
checkout's: the same for both, and the same KV events to index), a gateway run by
``valgrind --tool=callgrind`` in ``--router-mode``. Each
gateway serves ``--warmup`` chat requests (imports, caches, first connections), then its
counters are zeroed (``callgrind_control -z``), it serves ``--requests`` more, of the same
multi-turn shape, and the counters are dumped (``callgrind_control -d``): instructions over
those requests alone, start-up and shutdown excluded. Instruction counts are the same from
run to run within a fraction of a percent, however busy the machine, which timings are not.

Prints a table; ``--json FILE`` writes ``{"figures": {...}, "ratios": {...}}`` with
``instructions_per_request_vs_baseline`` (the baseline's / ours: >= 0.97 is the target).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
from benchkit import ROOT, Report, add_json_flag, print_table, progress

from kvsidecar.launch import ManagedProcess
from kvsidecar.local_stack import EngineSpec, LocalStack, StackSpec

MODEL = ROOT / "refengine" / "models" / "tiny"
_TOTALS = re.compile(rb"^(?:summary|totals):\s+(\d+)", re.MULTILINE)


def checkout(rev: str, where: Path) -> Path:
    """``rev`` of this repository as a detached worktree under ``where``."""
    path = where / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), rev],
                   check=True)
    return path


async def chats(url: str, n: int, seed: int) -> None:
    """``n`` requests: sessions of three turns over a shared system prompt, four at a time."""
    system = " ".join(f"rule {i} of the house" for i in range(60))

    async def session(session_id: int) -> None:
        messages = [{"role": "system", "content": system}]
        for turn in range(3):
            messages.append({"role": "user", "content": f"question {seed}-{session_id}-{turn}"})
            async with http.post(f"{url}/v1/chat/completions", json={
                    "model": "tiny", "messages": messages, "max_tokens": 8}) as resp:
                body = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"{url}: {resp.status} {body}")
            messages.append(body["choices"][0]["message"])

    async with aiohttp.ClientSession() as http:
        sessions = range(-(-n // 3))
        for start in range(0, len(sessions), 4):
            await asyncio.gather(*(session(s) for s in sessions[start:start + 4]))


async def wait_routable(url: str, workers: int) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(3000):
            async with http.get(f"{url}/v1/workers") as resp:
                listed = (await resp.json())["workers"]
            if sum(bool(w["routable"]) for w in listed) >= workers:
                return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url}: the workers never became routable")


def measure(name: str, tree: Path, sidecars: list[str], args: argparse.Namespace,
            workdir: Path) -> int:
    """Instructions the gateway of ``tree`` spent on ``--requests`` requests."""
    out = workdir / f"{name}.callgrind"
    wrapper = workdir / f"{name}-python"
    wrapper.write_text(f"#!/bin/sh\nexec valgrind --tool=callgrind --callgrind-out-file={out} "
                       f"{sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    gateway = ManagedProcess.start(
        f"gateway-{name}",
        ["routing", "--port", "0", "--model-path", str(MODEL), "--log-level", "warning",
         "--router-mode", args.router_mode, "--seed", "1",
         *[f for url in sidecars for f in ("--sidecar", url)]],
        workdir=workdir, env={"PYTHONPATH": str(tree)}, python=str(wrapper))
    try:
        gateway.wait_ready(600)
        asyncio.run(wait_routable(gateway.url, args.workers))
        asyncio.run(chats(gateway.url, args.warmup, seed=0))
        subprocess.run(["callgrind_control", "-z", str(gateway.proc.pid)], check=True,
                       capture_output=True)
        asyncio.run(chats(gateway.url, args.requests, seed=1))
        subprocess.run(["callgrind_control", "-d", str(gateway.proc.pid)], check=True,
                       capture_output=True)
    finally:
        gateway.stop()
    dumps = sorted(workdir.glob(f"{name}.callgrind.*"))  # the -d dump, not the final one
    if not dumps:
        raise RuntimeError(f"no callgrind dump for {name} in {workdir}")
    found = _TOTALS.search(dumps[0].read_bytes())
    if found is None:
        raise RuntimeError(f"{dumps[0]}: no totals line")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default="HEAD~1", metavar="REV",
                   help="the commit to compare with (default HEAD~1)")
    p.add_argument("--router-mode", default="kv", choices=["kv", "round-robin"])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--requests", type=int, default=150)
    add_json_flag(p)
    args = p.parse_args(argv)
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            p.error(f"{tool} is missing (Debian: apt-get install valgrind)")
    report = Report()
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp:
        work = Path(tmp)
        baseline = checkout(args.baseline, work)
        try:
            spec = StackSpec(engines=(EngineSpec(replicas=args.workers),), gateways=(),
                             max_total_tokens=65536)
            counts = {}
            for name, tree in (("ours", ROOT), ("baseline", baseline)):
                progress(f"{name}: a gateway under callgrind, {args.warmup} requests to "
                         f"warm up, then {args.requests} counted (minutes)")
                with LocalStack(spec, work / f"stack-{name}") as stack:
                    sidecars = [part.url for part in stack.sidecars]
                    counts[name] = measure(name, tree, sidecars, args, work)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(baseline)], check=False)
    per_request = {name: n / args.requests for name, n in counts.items()}
    print(f"\ngateway instructions per request, --router-mode {args.router_mode}, "
          f"{args.requests} requests after {args.warmup} to warm up; baseline {args.baseline}")
    print_table(["gateway", "instructions", "per request"],
                [[name, counts[name], round(per_request[name])] for name in counts])
    report.figure("instructions_per_request", round(per_request["ours"]))
    report.figure("baseline.instructions_per_request", round(per_request["baseline"]))
    report.ratio("instructions_per_request", "baseline", per_request["ours"],
                 per_request["baseline"], better="lower", ndigits=4)
    report.print_ratios("this checkout", {
        "instructions_per_request_vs_baseline": "(target >= 0.97)"})
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
