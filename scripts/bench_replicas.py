#!/usr/bin/env python3
"""Benchmark gateway replicas: one gateway against two that agree over NATS against two that
do not, on multi-turn chat loads behind a round-robin client-side split.

Each configuration runs on a fresh stack (``kvsidecar.local_stack``): ``--workers``
simulated reference engines (``refengine --compute sim``, each with a KV cache of the load's
size, so the sessions need several workers' caches) with their sidecars, and the gateways
(``kvsidecar gateway``; in the synced case a local ``nats-server`` and ``--nats``). Request
i goes to gateway i mod n, so a session's turns alternate between the replicas. Two loads
(``--load``), each a set of sessions in groups that share a long system prompt (an agent's
instructions, a shared document), each turn's prompt the whole conversation so far with the
replies the engine gave:

* ``groups``: 96 sessions in 12 groups (~700-token system prompts), 4 turns, started in
  waves of 24; each engine caches 6,144 tokens. The caches hold the 12 prompts and most
  conversations: hit rate is decided by where the first wave's new prompts go.
* ``capacity``: 384 sessions, each with one of 40 system prompts of ~2,000 tokens (drawn at
  random, seeded), 2 turns, 64 sessions in flight (a new one starts as one ends), the first
  64 together; each engine caches 16,384 tokens (1,024 blocks),
  so the 40 prompts alone (~80,000 tokens) overflow the four caches: capacity-bound, every
  prompt a worker holds evicts another.

Each configuration runs ``--repeats`` times on fresh stacks (the gateways' seeds differ per
run, the same for every configuration of one run; the workload is the same in every run),
interleaved, and the runs are pooled: one run's hit rate moves by a few percent with the
placements' timing, one gateway's too, so the script prints the single runs' spread and the
hit-rate ratio's standard error (figures ``<prefix><configuration>_hit_rate_run_sd``,
``<prefix>hit_rate_two_synced_vs_one_se``).

Cache hit rate: the engines' own ``cached_tokens`` over prompt tokens, summed over every
request. TTFT: time to the first streamed chunk, at the client. Workers per prompt: how many
workers served each system prompt's sessions in a run (the gateway's ``x-kvsidecar-worker``),
averaged over prompts and runs; copies beyond one cost cache. ``--trace DIR`` writes every
request (session, group, turn, gateway, the gateway's worker and placement headers, the
engine's cached tokens) as JSON lines, one file per run.

Prints a table per load; ``--json FILE`` writes ``{"figures": {...}, "ratios": {...}}``.
Ratios, >= 1 meaning the synced pair is as good or better than the baseline of the same run,
named with the load's prefix (none for ``groups``, ``capacity_`` for ``capacity``):
``hit_rate_two_synced_vs_one`` (target >= 0.98), ``hit_rate_two_synced_vs_two_unsynced``,
``ttft_p50_two_synced_vs_one`` and ``ttft_p99_two_synced_vs_two_unsynced`` (baseline TTFT /
synced TTFT).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp
from benchkit import ROOT, Report, add_json_flag, progress, ratio_se, run_spread, stream_reply

from kvsidecar.local_stack import EngineSpec, GatewaySpec, LocalStack, StackSpec

MODEL = ROOT / "refengine" / "models" / "tiny"
WORDS = ["cache", "token", "prefix", "block", "engine", "gateway", "replica", "memory",
         "placement", "request", "session", "worker", "stream", "answer", "context", "model",
         "prompt", "system", "user", "assistant"]
CONFIGS = (("one", 1, False), ("two_synced", 2, True), ("two_unsynced", 2, False))
_TRACE_HEADERS = (("worker", "x-kvsidecar-worker"),
                  ("predicted_blocks", "x-kvsidecar-cached-blocks"),
                  ("best_blocks", "x-kvsidecar-best-overlap-blocks"),
                  ("reason", "x-kvsidecar-placement-reason"))


@dataclass(frozen=True)
class Load:
    """One workload and the cache size it runs against (about 2.8 tokens per word)."""

    name: str
    prefix: str  # of its figure and ratio names
    cache_tokens: int  # each engine's KV cache
    groups: int  # system prompts, each shared by its sessions
    sessions: int
    turns: int
    concurrency: int  # sessions started together (waves) or kept in flight (continuous)
    continuous: bool
    drawn: bool  # each session's system prompt drawn at random (else session i's is i mod groups)
    system_words: int
    user_words: int = 40
    max_tokens: int = 24
    overlap_weight: float | None = None  # the gateways' --overlap-weight; None: learned
    quick: tuple[int, int, int] = (32, 4, 16)  # --quick: sessions, groups, concurrency

    def smoke(self) -> Load:
        """The load ``--quick`` runs instead."""
        sessions, groups, concurrency = self.quick
        return dataclasses.replace(self, sessions=sessions, groups=groups,
                                   concurrency=concurrency)


LOADS = {
    "groups": Load("groups", "", cache_tokens=6144, groups=12, sessions=96, turns=4,
                   concurrency=24, continuous=False, drawn=False, system_words=250,
                   overlap_weight=10.0,
                   quick=(32, 4, 16)),
    "capacity": Load("capacity", "capacity_", cache_tokens=16384, groups=40, sessions=384,
                     turns=2, concurrency=64, continuous=True, drawn=True, system_words=715,
                     quick=(128, 40, 64)),
}


@dataclass
class Result:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0
    failed: int = 0
    ttft_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    prompt_workers: list[int] = field(default_factory=list)  # per system prompt and run
    workers: dict[int, set[str]] = field(default_factory=dict)  # this run: prompt → workers
    # synced: new prompts held for their owner replica, and how the holds ended
    held: dict[str, float] = field(default_factory=dict)
    # each gateway's scorer weights at the end of each run (learned unless given)
    weights: list[tuple[float, float]] = field(default_factory=list)
    run_hit_rates: list[float] = field(default_factory=list)  # each run's own

    def merge(self, other: Result) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.requests += other.requests
        self.failed += other.failed
        self.ttft_s += other.ttft_s
        self.wall_s += other.wall_s
        self.prompt_workers += [len(w) for w in other.workers.values()]
        for name, value in other.held.items():
            self.held[name] = self.held.get(name, 0) + value
        self.weights += other.weights
        self.run_hit_rates.append(other.hit_rate)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def workers_per_prompt(self) -> float:
        n = self.prompt_workers
        return sum(n) / len(n) if n else 0.0

    @property
    def run_spread(self) -> float:
        """The standard deviation of single runs' hit rates, relative to the pooled one (0
        with fewer than two runs)."""
        return run_spread(self.run_hit_rates, self.hit_rate)

    def ttft(self, q: float) -> float:
        xs = sorted(self.ttft_s)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def text(rng: random.Random, words: int) -> str:
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(100)}" for _ in range(words))


@dataclass(frozen=True)
class Workload:
    systems: list[str]  # one per group
    groups: list[int]  # per session: its group
    turns: list[list[str]]  # per session: its user messages
    max_tokens: int

    @classmethod
    def make(cls, load: Load, seed: int) -> Workload:
        rng = random.Random(seed)
        systems = [text(rng, load.system_words) for _ in range(load.groups)]
        turns = [[text(rng, load.user_words) for _ in range(load.turns)]
                 for _ in range(load.sessions)]
        groups = [rng.randrange(load.groups) if load.drawn else i % load.groups
                  for i in range(load.sessions)]
        return cls(systems, groups, turns, load.max_tokens)


class Split:
    """Round-robin over the gateways, one request at a time, as a balancer would."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.next = 0

    def pick(self) -> tuple[int, str]:
        i = self.next % len(self.urls)
        self.next += 1
        return i, self.urls[i]


@dataclass
class Drive:
    """One run's client: the gateways, the workload, what it measured and, optionally, the
    trace it writes."""

    split: Split
    work: Workload
    result: Result
    trace: TextIO | None
    t0: float = field(default_factory=time.perf_counter)

    async def one_turn(self, session: aiohttp.ClientSession, messages: list[dict[str, str]],
                       ids: dict[str, int]) -> str:
        gateway, url = self.split.pick()
        result = self.result
        body = {"model": "tiny", "messages": messages, "max_tokens": self.work.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        reply = await stream_reply(session, f"{url}/v1/chat/completions", body)
        if reply.status != 200:
            result.failed += 1
            return ""
        result.requests += 1
        if reply.ttft_s is not None:
            result.ttft_s.append(reply.ttft_s)
        headers, usage = reply.headers, reply.usage
        worker = headers.get("x-kvsidecar-worker")
        if worker is not None:
            result.workers.setdefault(ids["group"], set()).add(worker)
        prompt = cached = 0
        if usage:
            prompt = usage["prompt_tokens"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            result.prompt_tokens += prompt
            result.cached_tokens += cached
        if self.trace is not None:
            row: dict[str, Any] = {"t_s": round(t0 - self.t0, 4), **ids, "gateway": gateway,
                                   "prompt_tokens": prompt, "cached_tokens": cached}
            row.update((key, headers.get(name)) for key, name in _TRACE_HEADERS)
            self.trace.write(json.dumps(row) + "\n")
        return reply.text

    async def conversation(self, session: aiohttp.ClientSession, i: int) -> None:
        work = self.work
        group = work.groups[i]
        messages = [{"role": "system", "content": work.systems[group]}]
        for turn, user in enumerate(work.turns[i]):
            messages.append({"role": "user", "content": user})
            reply = await self.one_turn(session, messages,
                                        {"session": i, "group": group, "turn": turn})
            messages.append({"role": "assistant", "content": reply})


async def drive(urls: list[str], work: Workload, load: Load, trace: TextIO | None) -> Result:
    run = Drive(Split(urls), work, Result(), trace)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    n = len(work.turns)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        if load.continuous:
            todo = iter(range(n))

            async def slot() -> None:
                for i in todo:  # shared: each slot takes the next session as it frees
                    await run.conversation(session, i)

            await asyncio.gather(*(slot() for _ in range(min(n, load.concurrency))))
        else:
            for start in range(0, n, load.concurrency):
                wave = range(start, min(n, start + load.concurrency))
                await asyncio.gather(*(run.conversation(session, i) for i in wave))
        run.result.wall_s = time.perf_counter() - t0
    return run.result


def metric(text: str, name: str) -> float:
    """One unlabelled sample of a Prometheus text page (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


_HOLDS = ("held", "held_followed", "held_claimed", "held_timed_out")


async def holds(urls: list[str]) -> dict[str, float]:
    """The synced gateways' new-prompt holds, summed (routing/replicas/prompt_hold.py)."""
    total = dict.fromkeys(_HOLDS, 0.0)
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(f"{url}/metrics") as resp:
                page = await resp.text()
            for name in _HOLDS:
                total[name] += metric(
                    page, f"kvsidecar_gateway_replica_new_prompts_{name}_total")
    return total


async def scorer_weights(urls: list[str]) -> list[tuple[float, float]]:
    """Each gateway's (overlap weight, prefill load scale) now (``/v1/workers``)."""
    out = []
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(f"{url}/v1/workers") as resp:
                scorer = (await resp.json())["scorer"]
            out.append((float(scorer["overlap_weight"]), float(scorer["prefill_load_scale"])))
    return out


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


def run_config(name: str, gateways: int, synced: bool, args: argparse.Namespace, load: Load,
               work: Workload, tmp: Path, repeat: int) -> Result:
    workdir = tmp / f"{load.name}-{name}-{repeat}"
    w = load.overlap_weight if args.overlap_weight is None else args.overlap_weight
    weight = () if w is None else ("--overlap-weight", str(w))
    spec = StackSpec(
        engines=(EngineSpec(replicas=args.workers),),
        # the gateway's own health-check interval; the peers are waited for below
        gateways=(GatewaySpec(count=gateways, seed=repeat * 10, health_check_interval_s=10.0,
                              args=(*weight, *args.gateway_arg), wait_routable=False),),
        model_path=str(MODEL), max_total_tokens=load.cache_tokens, speedup=args.speedup,
        log_level="warning", nats=synced,
    )
    with LocalStack(spec, workdir) as stack:
        gw_urls = [gw.url for gw in stack.gateways]
        asyncio.run(wait_routable(gw_urls, args.workers, synced))
        if args.trace is None:
            result = asyncio.run(drive(gw_urls, work, load, None))
        else:
            args.trace.mkdir(parents=True, exist_ok=True)
            with (args.trace / f"{workdir.name}.jsonl").open("w") as trace:
                result = asyncio.run(drive(gw_urls, work, load, trace))
        if synced:
            result.held = asyncio.run(holds(gw_urls))
        result.weights = asyncio.run(scorer_weights(gw_urls))
        return result


def report(load: Load, args: argparse.Namespace, results: dict[str, Result],
           out: Report) -> None:
    """Print one load's table and ratios; add them to ``out``."""
    print(f"\n{load.name}: {args.workers} simulated workers x {load.cache_tokens} cache tokens; "
          f"{load.sessions} sessions over {load.groups} system prompts x {load.turns} turns, "
          f"{load.concurrency} {'in flight' if load.continuous else 'at once'}; "
          f"round-robin split; {args.repeats} run(s) pooled\n")
    print("| configuration | requests | failed | cache hit rate | workers per prompt "
          "| TTFT p50 ms | TTFT p99 ms | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    p = load.prefix
    mine = Report()  # this load's
    for name, r in results.items():
        print(f"| {name.replace('_', ' ')} | {r.requests} | {r.failed} | {r.hit_rate:.3f} | "
              f"{r.workers_per_prompt:.2f} | {r.ttft(0.5) * 1e3:.1f} | "
              f"{r.ttft(0.99) * 1e3:.1f} | {r.wall_s:.1f} |")
        mine.figure(f"{p}{name}_hit_rate", r.hit_rate)
        mine.figure(f"{p}{name}_workers_per_prompt", r.workers_per_prompt)
        mine.figure(f"{p}{name}_ttft_p50_s", r.ttft(0.5))
        mine.figure(f"{p}{name}_ttft_p99_s", r.ttft(0.99))
        mine.figure(f"{p}{name}_failed", r.failed)
        mine.figure(f"{p}{name}_prompt_tokens", r.prompt_tokens)
    one, pair, unsynced = results["one"], results["two_synced"], results["two_unsynced"]
    # How far one figure moves between runs of the same configuration (timing alone: the
    # workload and the gateways' seeds are the same in every configuration of a repeat), and
    # so the standard error of the pooled hit-rate ratio: one gateway against itself spreads
    # by a few percent a run (docs/bench/replicas.md).
    print("\nhit rate of single runs (min-max, sd relative to the pooled):")
    for name, r in results.items():
        xs = r.run_hit_rates
        print(f"  {name.replace('_', ' ')}: {min(xs):.3f}-{max(xs):.3f}, sd {r.run_spread:.3f}")
        mine.figure(f"{p}{name}_hit_rate_run_sd", r.run_spread)
    se = ratio_se(pair.hit_rate / one.hit_rate, pair.run_spread, one.run_spread,
                  args.repeats) if one.hit_rate else 0.0
    print(f"  hit_rate_two_synced_vs_one: standard error {se:.3f} ({args.repeats} runs)")
    mine.figure(f"{p}hit_rate_two_synced_vs_one_se", se)
    print("\nscorer weights at the end of each run (overlap weight / prefill load scale):")
    for name, r in results.items():
        print(f"  {name.replace('_', ' ')}: "
              + ", ".join(f"{w:.1f} / {s:.1f}" for w, s in r.weights))
    held = pair.held
    if held:
        print(f"\ntwo synced: {held['held']:.0f} new prompts held for their owner replica: "
              f"{held['held_followed']:.0f} followed its placement, {held['held_claimed']:.0f} "
              f"placed where it said once asked, {held['held_timed_out']:.0f} "
              "at the hold's limit")
        mine.figure(f"{p}two_synced_prompts_held", held["held"])
        mine.figure(f"{p}two_synced_prompts_held_timed_out", held["held_timed_out"])
    mine.ratio(f"{p}hit_rate_two_synced", "one", pair.hit_rate, one.hit_rate, better="higher")
    mine.ratio(f"{p}hit_rate_two_synced", "two_unsynced", pair.hit_rate, unsynced.hit_rate,
               better="higher")
    mine.ratio(f"{p}ttft_p50_two_synced", "one", pair.ttft(0.5), one.ttft(0.5), better="lower")
    mine.ratio(f"{p}ttft_p99_two_synced", "two_unsynced", pair.ttft(0.99), unsynced.ttft(0.99),
               better="lower")
    mine.print_ratios("two synced replicas")
    out.include(mine, prefix="")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Method and figures: docs/bench/replicas.md.")
    p.add_argument("--load", choices=[*LOADS, "all"], default="all",
                   help="which workload (default all: groups, then capacity)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--speedup", type=float, default=1.0, help="of the simulated engines")
    p.add_argument("--overlap-weight", type=float,
                   help="the gateways' --overlap-weight for every load (default: the load's "
                   "own, 10 for groups, learned for capacity)")
    p.add_argument("--seed", type=int, default=1, help="of the workload")
    p.add_argument("--repeats", type=int, default=3,
                   help="fresh stacks per configuration, pooled (default 3)")
    p.add_argument("--quick", action="store_true", help="smaller workloads, 1 run (smoke)")
    p.add_argument("--trace", type=Path, metavar="DIR", help="write every request here")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every gateway, e.g. "
                   "--gateway-arg=--prefill-load-scale=10 (repeatable)")
    add_json_flag(p)
    args = p.parse_args(argv)
    loads = list(LOADS.values()) if args.load == "all" else [LOADS[args.load]]
    if args.quick:
        args.repeats = 1
        loads = [load.smoke() for load in loads]
    out = Report()
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        for load in loads:
            work = Workload.make(load, args.seed)
            results: dict[str, Result] = {}
            for repeat in range(args.repeats):  # interleaved: drift hits every configuration
                for name, gateways, synced in CONFIGS:
                    progress(f"running {load.name} {name} ({repeat + 1}/{args.repeats}) ...")
                    one = run_config(name, gateways, synced, args, load, work, Path(tmp),
                                     repeat)
                    results.setdefault(name, Result()).merge(one)
            report(load, args, results, out)
    if args.json:
        out.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
