#!/usr/bin/env python3
"""Benchmark gateway replicas: one gateway against two that agree over NATS against two that
do not, on a multi-turn chat workload behind a round-robin client-side split.

Each configuration runs on a fresh stack: a local ``nats-server``, ``--workers`` simulated
reference engines (``refengine --compute sim``, each KV cache ``--cache-tokens`` tokens, so
the sessions need several workers' caches: more than one worker holds) with their sidecars,
and the gateways (``kvsidecar gateway``, with ``--nats`` in the synced case). The workload:
``--groups`` groups of sessions, each group sharing a long system prompt (an agent's
instructions, a shared document), ``--sessions`` sessions in all, ``--turns`` turns each (each
turn's prompt is the whole conversation so far, with the replies the engine gave), sessions
started together in waves of ``--concurrency``; request i goes to gateway i mod n, so a
session's turns alternate between the replicas. Each configuration runs ``--repeats`` times
on fresh stacks (the gateways' seeds differ per run), interleaved, and the runs are pooled:
one run's hit rate moves by a few percent with the placements' timing.

Cache hit rate: the engines' own ``cached_tokens`` over prompt tokens, summed over every
request. TTFT: time to the first streamed chunk, at the client.

Prints a table; ``--json FILE`` writes ``{"figures": {...}, "ratios": {...}}``. Ratios,
>= 1 meaning the synced pair is as good or better than the baseline of the same run:
``hit_rate_two_synced_vs_one`` (target >= 0.98), ``hit_rate_two_synced_vs_two_unsynced``,
``ttft_p50_two_synced_vs_one`` and ``ttft_p99_two_synced_vs_two_unsynced`` (baseline TTFT /
synced TTFT).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsidecar.launch import ManagedProcess
from kvsidecar.local_nats import NatsServer

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "refengine" / "models" / "tiny"
EVENTS = json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                     "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"})
WORDS = ["cache", "token", "prefix", "block", "engine", "gateway", "replica", "memory",
         "placement", "request", "session", "worker", "stream", "answer", "context", "model",
         "prompt", "system", "user", "assistant"]
CONFIGS = (("one", 1, False), ("two_synced", 2, True), ("two_unsynced", 2, False))


@dataclass
class Result:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0
    failed: int = 0
    ttft_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def merge(self, other: Result) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.requests += other.requests
        self.failed += other.failed
        self.ttft_s += other.ttft_s
        self.wall_s += other.wall_s

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def ttft(self, q: float) -> float:
        xs = sorted(self.ttft_s)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def text(rng: random.Random, words: int) -> str:
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(100)}" for _ in range(words))


@dataclass(frozen=True)
class Workload:
    systems: list[str]  # one per group
    turns: list[list[str]]  # per session: its user messages
    max_tokens: int

    @classmethod
    def make(cls, args: argparse.Namespace) -> Workload:
        rng = random.Random(args.seed)
        systems = [text(rng, args.system_words) for _ in range(args.groups)]
        turns = [[text(rng, args.user_words) for _ in range(args.turns)]
                 for _ in range(args.sessions)]
        return cls(systems, turns, args.max_tokens)


class Split:
    """Round-robin over the gateways, one request at a time, as a balancer would."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.next = 0

    def url(self) -> str:
        url = self.urls[self.next % len(self.urls)]
        self.next += 1
        return url


async def one_turn(session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]],
                   max_tokens: int, result: Result) -> str:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    usage = None
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            result.failed += 1
            await resp.read()
            return ""
        async for line in resp.content:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - t0
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            parts += [(c.get("delta") or {}).get("content") or ""
                      for c in chunk.get("choices") or ()]
    result.requests += 1
    if first is not None:
        result.ttft_s.append(first)
    if usage:
        result.prompt_tokens += usage["prompt_tokens"]
        result.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return "".join(parts)


async def conversation(session: aiohttp.ClientSession, split: Split, work: Workload, i: int,
                       result: Result) -> None:
    messages = [{"role": "system", "content": work.systems[i % len(work.systems)]}]
    for user in work.turns[i]:
        messages.append({"role": "user", "content": user})
        reply = await one_turn(session, split.url(), messages, work.max_tokens, result)
        messages.append({"role": "assistant", "content": reply})


async def drive(urls: list[str], work: Workload, concurrency: int) -> Result:
    result = Result()
    split = Split(urls)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        for start in range(0, len(work.turns), concurrency):
            wave = range(start, min(len(work.turns), start + concurrency))
            await asyncio.gather(*(conversation(session, split, work, i, result) for i in wave))
        result.wall_s = time.perf_counter() - t0
    return result


def metric(text: str, name: str) -> float:
    """One unlabelled sample of a Prometheus text page (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


async def wait_routable(urls: list[str], workers: int, synced: bool) -> None:
    """Until every gateway routes to every worker and, synced, hears every other gateway."""
    async with aiohttp.ClientSession() as session:
        for url in urls:
            deadline = time.monotonic() + 60
            while True:
                async with session.get(f"{url}/v1/workers") as resp:
                    listed = (await resp.json())["workers"]
                peers: float = len(urls) - 1
                if synced:
                    async with session.get(f"{url}/metrics") as resp:
                        peers = metric(await resp.text(), "kvsidecar_gateway_replica_peers")
                if sum(bool(w["routable"]) for w in listed) >= workers and peers >= len(urls) - 1:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url}: workers never became routable ({listed}) "
                                       f"or peers never heard ({peers})")
                await asyncio.sleep(0.1)


def run_config(name: str, gateways: int, synced: bool, args: argparse.Namespace,
               work: Workload, tmp: Path, repeat: int) -> Result:
    workdir = tmp / f"{name}-{repeat}"
    procs: list[ManagedProcess] = []
    nats = NatsServer(workdir.parent).start() if synced else None
    try:
        engines = ManagedProcess.start(
            "engines",
            ["refengine", "--compute", "sim", "--replicas", str(args.workers), "--port", "0",
             "--max-total-tokens", str(args.cache_tokens), "--speedup", str(args.speedup),
             "--kv-events-config", EVENTS, "--log-level", "warning"],
            workdir=workdir,
        )
        procs.append(engines)
        urls = [r["url"] for r in engines.wait_ready(90, count=args.workers)]
        sidecars = [ManagedProcess.start(
            f"sidecar-{i}", ["sidecar", "--engine-url", url, "--worker-id", f"w{i}",
                             "--port", "0", "--log-level", "warning"], workdir=workdir)
            for i, url in enumerate(urls)]
        procs += sidecars
        for sc in sidecars:
            sc.wait_ready(90)
        flags = [f for sc in sidecars for f in ("--sidecar", sc.url)]
        extra = ["--nats", nats.url] if nats is not None else []
        gws = [ManagedProcess.start(
            f"gateway-{g}",
            ["routing", "--port", "0", "--model-path", str(MODEL), "--log-level", "warning",
             "--overlap-weight", str(args.overlap_weight), "--seed", str(repeat * 10 + g),
             *flags, *extra],
            workdir=workdir) for g in range(gateways)]
        procs += gws
        for gw in gws:
            gw.wait_ready(90)
        gw_urls = [gw.url for gw in gws]
        asyncio.run(wait_routable(gw_urls, args.workers, synced))
        return asyncio.run(drive(gw_urls, work, args.concurrency))
    finally:
        for proc in reversed(procs):
            proc.stop()
        if nats is not None:
            nats.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Method and figures: docs/bench/replicas.md.")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--cache-tokens", type=int, default=6144,
                   help="each engine's KV cache, tokens (default 6144)")
    p.add_argument("--groups", type=int, default=12, help="system prompts shared by sessions")
    p.add_argument("--sessions", type=int, default=96)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=24, help="sessions started together")
    p.add_argument("--system-words", type=int, default=250)
    p.add_argument("--user-words", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--speedup", type=float, default=1.0, help="of the simulated engines")
    p.add_argument("--overlap-weight", type=float, default=10.0,
                   help="the gateways' --overlap-weight (default 10: multi-turn chat)")
    p.add_argument("--seed", type=int, default=1, help="of the workload")
    p.add_argument("--repeats", type=int, default=3,
                   help="fresh stacks per configuration, pooled (default 3)")
    p.add_argument("--quick", action="store_true", help="a smaller workload (smoke run)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write figures and ratios here")
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.groups, args.concurrency, args.repeats = 32, 4, 16, 1
    work = Workload.make(args)
    results: dict[str, Result] = {}
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        for repeat in range(args.repeats):  # interleaved: drift hits every configuration
            for name, gateways, synced in CONFIGS:
                print(f"running {name} ({repeat + 1}/{args.repeats}) ...", file=sys.stderr,
                      flush=True)
                one = run_config(name, gateways, synced, args, work, Path(tmp), repeat)
                results.setdefault(name, Result()).merge(one)

    print(f"\n{args.workers} simulated workers x {args.cache_tokens} cache tokens; "
          f"{args.sessions} sessions in {args.groups} groups x {args.turns} turns, "
          f"{args.concurrency} at once; round-robin split; {args.repeats} run(s) pooled\n")
    print("| configuration | requests | failed | cache hit rate | TTFT p50 ms | TTFT p99 ms "
          "| wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    figures: dict[str, float] = {}
    for name, r in results.items():
        print(f"| {name.replace('_', ' ')} | {r.requests} | {r.failed} | {r.hit_rate:.3f} | "
              f"{r.ttft(0.5) * 1e3:.1f} | {r.ttft(0.99) * 1e3:.1f} | {r.wall_s:.1f} |")
        figures[f"{name}_hit_rate"] = r.hit_rate
        figures[f"{name}_ttft_p50_s"] = r.ttft(0.5)
        figures[f"{name}_ttft_p99_s"] = r.ttft(0.99)
        figures[f"{name}_failed"] = r.failed
        figures[f"{name}_prompt_tokens"] = r.prompt_tokens
    one, pair, unsynced = results["one"], results["two_synced"], results["two_unsynced"]
    ratios = {
        "hit_rate_two_synced_vs_one": pair.hit_rate / one.hit_rate,
        "hit_rate_two_synced_vs_two_unsynced": pair.hit_rate / unsynced.hit_rate,
        "ttft_p50_two_synced_vs_one": one.ttft(0.5) / pair.ttft(0.5),
        "ttft_p99_two_synced_vs_two_unsynced": unsynced.ttft(0.99) / pair.ttft(0.99),
    }
    print("\nratios (>= 1: two synced replicas as good or better):")
    for key, value in ratios.items():
        print(f"  {key:<40} {value:7.3f}")
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "ratios": ratios}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
