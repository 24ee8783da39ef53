#!/usr/bin/env python3
"""Benchmark the gateway's CPU instructions per request under callgrind, against other
commits of ours: the check that a change costs the hot path nothing (issue #29: at most 3 %).

For this checkout and for each ``--baseline REV`` (checked out into a temporary git
worktree), each on a fresh stack of ``--workers`` simulated reference engines with their
sidecars (this checkout's: the same for all, and the same KV events to index), a gateway
run by ``valgrind --tool=callgrind`` in ``--router-mode``. Each gateway serves ``--warmup``
chat requests of each kind (imports, caches, first connections), then it is counted twice:
its counters are zeroed (``callgrind_control -z``), it serves ``--requests`` non-streamed
requests of the same multi-turn shape, and the counters are dumped (``callgrind_control
-d``); then the same for ``--requests`` streamed ones (``"stream": true``, ``--max-tokens``
chunks each: the per-chunk work, decode-interference timing among it, is priced there).
Instructions over those requests alone, start-up and shutdown excluded. Instruction counts
are the same from run to run within a fraction of a percent, however busy the machine,
which timings are not.

Prints a table; ``--json FILE`` writes ``{"figures": {...}, "ratios": {...}}`` with
``instructions_per_request_vs_<rev>`` and ``streamed_instructions_per_request_vs_<rev>``
per baseline (its count / ours: >= 0.97 is the target).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import aiohttp
from benchkit import ROOT, Report, add_json_flag, print_table, progress, stream_reply

from kvsidecar.launch import ManagedProcess
from kvsidecar.local_stack import (
    EngineSpec,
    GatewaySpec,
    LocalStack,
    StackSpec,
    gateway_argv,
    routable_workers,
)

MODEL = ROOT / "refengine" / "models" / "tiny"
_TOTALS = re.compile(rb"^(?:summary|totals):\s+(\d+)", re.MULTILINE)
KINDS = {"": False, "streamed_": True}  # figure prefix → whether its requests stream


def short_rev(rev: str) -> str:
    """``rev``'s abbreviated commit id: the baseline's name in figures and ratios."""
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", f"{rev}^{{commit}}"],
                          check=True, capture_output=True, text=True).stdout.strip()


def checkout(rev: str, where: Path) -> Path:
    """``rev`` of this repository as a detached worktree under ``where``."""
    path = where / f"tree-{rev}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), rev],
                   check=True)
    return path


async def reply_message(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]],
                        max_tokens: int, stream: bool) -> dict[str, str]:
    """One chat turn's reply, as the next turn carries it."""
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens}
    if stream:
        reply = await stream_reply(http, f"{url}/v1/chat/completions", {**body, "stream": True})
        if reply.status != 200:
            raise RuntimeError(f"{url}: {reply.status} {reply.error}")
        return {"role": "assistant", "content": reply.text}
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        answer = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {answer}")
    return dict(answer["choices"][0]["message"])


async def chats(url: str, n: int, seed: int, max_tokens: int, stream: bool) -> None:
    """``n`` requests: sessions of three turns over a shared system prompt, four at a time."""
    system = " ".join(f"rule {i} of the house" for i in range(60))

    async def session(session_id: int) -> None:
        messages = [{"role": "system", "content": system}]
        for turn in range(3):
            messages.append({"role": "user", "content": f"question {seed}-{session_id}-{turn}"})
            messages.append(await reply_message(http, url, messages, max_tokens, stream))

    async with aiohttp.ClientSession() as http:
        sessions = range(-(-n // 3))
        for start in range(0, len(sessions), 4):
            await asyncio.gather(*(session(s) for s in sessions[start:start + 4]))


def measure(name: str, tree: Path, sidecars: list[str], args: argparse.Namespace,
            workdir: Path, flags: Sequence[str] = ()) -> dict[str, int]:
    """Instructions the gateway of ``tree`` (with ``flags``) spent on ``--requests``
    requests of each kind (``KINDS``)."""
    out = workdir / f"{name}.callgrind"
    spec = GatewaySpec(router_mode=args.router_mode, health_check_interval_s=None,
                       args=("--log-level", "warning", *flags))
    # PYTHONSAFEPATH: ``python -m`` would put the current directory first on sys.path, so a
    # baseline's gateway run from this checkout would import this checkout's code.
    gateway = ManagedProcess.start(
        f"gateway-{name}", ["routing", *gateway_argv(spec, str(MODEL), sidecars,
                                                     more=["--seed", "1"])],
        workdir=workdir, env={"PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1"},
        prefix=["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"])
    try:
        gateway.wait_ready(600)
        routable_workers(gateway.url, args.workers, timeout_s=300)
        for stream in KINDS.values():
            asyncio.run(chats(gateway.url, args.warmup, 0, args.max_tokens, stream))
        for seed, stream in enumerate(KINDS.values(), start=1):
            subprocess.run(["callgrind_control", "-z", str(gateway.proc.pid)], check=True,
                           capture_output=True)
            asyncio.run(chats(gateway.url, args.requests, seed, args.max_tokens, stream))
            subprocess.run(["callgrind_control", "-d", str(gateway.proc.pid)], check=True,
                           capture_output=True)
    finally:
        gateway.stop()
    counts = {}
    for kind, number in zip(KINDS, range(1, len(KINDS) + 1), strict=True):
        dump = out.with_name(f"{out.name}.{number}")  # the -d dumps, in order; not the final one
        if not dump.exists():
            raise RuntimeError(f"no callgrind dump {dump.name} for {name} in {workdir}")
        found = _TOTALS.search(dump.read_bytes())
        if found is None:
            raise RuntimeError(f"{dump}: no totals line")
        counts[kind] = int(found.group(1))
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", action="append", metavar="REV",
                   help="a commit to compare with, repeated for several (default HEAD~1)")
    p.add_argument("--router-mode", default="kv", choices=["kv", "round-robin"])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=30, help="requests of each kind, uncounted")
    p.add_argument("--requests", type=int, default=150, help="requests of each kind, counted")
    p.add_argument("--max-tokens", type=int, default=8,
                   help="output tokens per request (a streamed reply's chunks)")
    p.add_argument("--variant", action="append", metavar="NAME=FLAGS", default=[],
                   help="also this checkout's gateway with FLAGS (one string), as NAME: e.g. "
                        "no_learner='--decode-interference-weight 0' leaves out a feature the "
                        "baselines lack, to tell its cost from the rest's")
    add_json_flag(p)
    args = p.parse_args(argv)
    variants: dict[str, list[str]] = {}
    for spec_text in args.variant:
        name, sep, flags = spec_text.partition("=")
        if not sep or not name.isidentifier() or not flags.split():
            p.error(f"--variant {spec_text!r}: expected NAME=FLAGS, NAME a word")
        variants[name] = flags.split()
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            p.error(f"{tool} is missing (Debian: apt-get install valgrind)")
    baselines = {short_rev(rev): rev for rev in args.baseline or ["HEAD~1"]}
    report = Report()
    counts: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp:
        work = Path(tmp)
        trees = {"ours": ROOT}
        arms = {"ours": ("ours", [])} | {f"ours_{v}": ("ours", f) for v, f in variants.items()}
        try:
            for name in baselines:
                trees[name] = checkout(name, work)
                arms[name] = (name, [])
            spec = StackSpec(engines=(EngineSpec(replicas=args.workers),), gateways=(),
                             max_total_tokens=65536)
            for name, (tree_name, flags) in arms.items():
                progress(f"{name}: a gateway under callgrind, {args.warmup} requests of each "
                         f"kind to warm up, then {args.requests} counted of each (minutes)")
                with LocalStack(spec, work / f"stack-{name}") as stack:
                    sidecars = [part.url for part in stack.sidecars]
                    counts[name] = measure(name, trees[tree_name], sidecars, args, work,
                                           flags)
        finally:
            for name, tree in trees.items():
                if name != "ours":
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                    str(tree)], check=False)
    per_request = {name: {kind: n / args.requests for kind, n in by_kind.items()}
                   for name, by_kind in counts.items()}
    print(f"\ngateway instructions per request, --router-mode {args.router_mode}, "
          f"{args.requests} requests of each kind after {args.warmup} to warm up, "
          f"{args.max_tokens} output tokens each; baselines "
          + ", ".join(f"{name} ({rev})" for name, rev in baselines.items())
          + "".join(f"; ours_{v}: {' '.join(f)}" for v, f in variants.items()))
    print_table(["gateway", "non-streamed", "streamed"],
                [[name, round(by_kind[""]), round(by_kind["streamed_"])]
                 for name, by_kind in per_request.items()])
    notes = {}
    for name, by_kind in per_request.items():
        for kind, value in by_kind.items():
            report.figure(f"{name}.{kind}instructions_per_request", round(value))
    for name in baselines:
        for ours in (n for n in per_request if n.startswith("ours")):
            for kind, value in per_request[name].items():
                figure = f"{kind}instructions_per_request{ours[len('ours'):]}"
                report.ratio(figure, name, per_request[ours][kind], value, better="lower",
                             ndigits=4)
                notes[f"{figure}_vs_{name}"] = "(target >= 0.97)"
    report.print_ratios("this checkout", notes)
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
