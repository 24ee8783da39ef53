#!/usr/bin/env python3
"""Benchmark what users of an overloaded fleet feel: each tenant's share when one floods.

``--load flood`` (the only load so far; issue #32 adds the goodput loads against Dynamo):
three tenants, each an API key of the gateway's ``--api-key-file`` with weight 1, drive
closed loops of one-turn chats against ``--workers`` simulated reference engines
(``refengine --compute sim``) behind one gateway that admits ``--slots`` requests per worker
and queues the rest (``--queue-timeout-s``). The flooding tenant keeps ``--flood-clients``
requests in flight, each quiet tenant ``--quiet-clients``: together far more than the
fleet's slots, so every tenant is backlogged and the queue decides who is served. The same
load runs twice on fresh stacks, with the queue ordered by the tenants' fair shares
(``--queue-order fair``, ours) and first come, first served (``fcfs``, the baseline: what a
least-loaded router with a queue gives), for ``--warmup-s`` and then ``--duration-s`` each.

Per tenant, over the requests sent after the warm-up and finished within the run: requests
served, tokens served (prompt + completion, from the replies' usage), TTFT p50 and p99 at
the client. (The warm-up is the start, when every client sends at once and the slots go to
whoever arrives first, before any request waits.) Jain's fairness index over the tenants'
tokens served (divided by their weights): 1 when every tenant got the same share, 1/n when
one got all.

Prints a table per ordering; ``--json FILE`` writes ``{"figures": {...}, "ratios": {...}}``
with ``fairness_vs_least_loaded`` (ours / the baseline's Jain index, target >= 1) and
``quiet_ttft_p50_vs_least_loaded`` (the quiet tenants' TTFT p50, the baseline's / ours).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from benchkit import ROOT, Report, add_json_flag, print_table, progress, stream_reply

from kvsidecar.local_stack import EngineSpec, GatewaySpec, LocalStack, StackSpec

MODEL = ROOT / "refengine" / "models" / "tiny"
WORDS = ["cache", "token", "prefix", "block", "engine", "gateway", "replica", "memory",
         "placement", "request", "session", "worker", "stream", "answer", "context", "model"]
TENANTS = ("flood", "quiet-a", "quiet-b")
ORDERS = (("fair", "ours"), ("fcfs", "least_loaded"))


@dataclass
class Tenant:
    name: str
    clients: int
    requests: int = 0
    failed: int = 0
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)

    def ttft(self, q: float) -> float:
        if not self.ttft_s:
            return 0.0
        ttft = sorted(self.ttft_s)
        return ttft[min(len(ttft) - 1, int(q * len(ttft)))]


def jain(values: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2)."""
    total, squares = sum(values), sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else 0.0


async def client(session: aiohttp.ClientSession, url: str, tenant: Tenant, seed: int,
                 counted_from: float, until: float, args: argparse.Namespace) -> None:
    rng = random.Random(seed)
    headers = {"authorization": f"Bearer {tenant.name}-key"}
    while time.perf_counter() < until:
        words = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
        body = {"model": "tiny", "messages": [{"role": "user", "content": words}],
                "max_tokens": args.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        reply = await stream_reply(session, f"{url}/v1/chat/completions", body, headers=headers)
        if reply.status != 200:
            tenant.failed += 1
            continue
        first, usage = reply.ttft_s, reply.usage
        if time.perf_counter() > until:
            break  # finished after the window: not counted, for either ordering
        if t0 < counted_from:
            continue  # sent during the warm-up
        tenant.requests += 1
        if first is not None:
            tenant.ttft_s.append(first)
        if usage:
            tenant.tokens += usage["prompt_tokens"] + usage["completion_tokens"]


async def drive(url: str, tenants: list[Tenant], args: argparse.Namespace) -> None:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    connector = aiohttp.TCPConnector(limit=0)
    counted_from = time.perf_counter() + args.warmup_s
    until = counted_from + args.duration_s
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(client(session, url, t, i * 1000 + c, counted_from, until, args)
                               for i, t in enumerate(tenants) for c in range(t.clients)))


async def wait_routable(url: str, workers: int) -> None:
    headers = {"authorization": f"Bearer {TENANTS[0]}-key"}
    async with aiohttp.ClientSession(headers=headers) as session:
        deadline = time.monotonic() + 60
        while True:
            async with session.get(f"{url}/v1/workers") as resp:
                listed = (await resp.json())["workers"]
            if sum(bool(w["routable"]) for w in listed) >= workers:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}: workers never became routable ({listed})")
            await asyncio.sleep(0.1)


def run(order: str, args: argparse.Namespace, tmp: Path) -> list[Tenant]:
    workdir = tmp / order
    workdir.mkdir(parents=True)
    keys = workdir / "keys.txt"
    keys.write_text("".join(f"{t}-key {t} weight=1\n" for t in TENANTS))
    spec = StackSpec(
        # plain workers without KV events, no sidecars: the gateway's queue is measured
        engines=(EngineSpec(replicas=args.workers, sidecars=False),),
        gateways=(GatewaySpec(
            router_mode="least-loaded", workers="engines", health_check_interval_s=10.0,
            wait_routable=False,  # below, with an API key
            args=("--api-key-file", str(keys), "--max-in-flight-per-worker", str(args.slots),
                  "--queue-timeout-s", str(args.queue_timeout_s), "--queue-order", order)),),
        model_path=str(MODEL), events_config='{"publisher": "null"}', log_level="warning")
    with LocalStack(spec, workdir) as stack:
        asyncio.run(wait_routable(stack.url, args.workers))
        tenants = [Tenant(TENANTS[0], args.flood_clients),
                   *(Tenant(name, args.quiet_clients) for name in TENANTS[1:])]
        asyncio.run(drive(stack.url, tenants, args))
        return tenants


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", choices=["flood"], default="flood")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--slots", type=int, default=4, help="requests in flight per worker")
    p.add_argument("--flood-clients", type=int, default=32)
    p.add_argument("--quiet-clients", type=int, default=4)
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--warmup-s", type=float, default=3.0,
                   help="of each ordering's run, before requests are counted")
    p.add_argument("--duration-s", type=float, default=20.0,
                   help="of each ordering's run, counted")
    p.add_argument("--queue-timeout-s", type=float, default=120.0)
    add_json_flag(p)
    args = p.parse_args(argv)
    report = Report()
    results: dict[str, list[Tenant]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp:
        for order, name in ORDERS:
            progress(f"running {args.load} with --queue-order {order} for {args.duration_s:g}s")
            results[name] = run(order, args, Path(tmp))
    print(f"\n{args.load}: {args.workers} simulated workers x {args.slots} slots; tenants "
          f"{TENANTS[0]} ({args.flood_clients} clients), {', '.join(TENANTS[1:])} "
          f"({args.quiet_clients} clients each), all weight 1; {args.duration_s:g}s each")
    fairness: dict[str, float] = {}
    quiet_ttft: dict[str, float] = {}
    for order, name in ORDERS:
        tenants = results[name]
        total = sum(t.tokens for t in tenants) or 1
        print(f"\n--queue-order {order} ({name}):")
        print_table(["tenant", "clients", "requests", "failed", "tokens", "share",
                     "TTFT p50 ms", "TTFT p99 ms"],
                    [[t.name, t.clients, t.requests, t.failed, t.tokens,
                      round(t.tokens / total, 3), round(t.ttft(0.5) * 1000, 1),
                      round(t.ttft(0.99) * 1000, 1)] for t in tenants])
        fairness[name] = jain([float(t.tokens) for t in tenants])
        quiet_ttft[name] = statistics.median(
            [s for t in tenants[1:] for s in t.ttft_s] or [0.0])
        report.figure(f"{name}.jain_index", round(fairness[name], 4))
        report.figure(f"{name}.quiet_ttft_p50_s", round(quiet_ttft[name], 4))
        report.figure(f"{name}.tokens_per_s",
                      round(sum(t.tokens for t in tenants) / args.duration_s, 1))
        for t in tenants:
            report.figure(f"{name}.{t.name}.tokens", t.tokens)
        print(f"Jain's fairness index over tenants' tokens: {fairness[name]:.3f}")
    report.ratio("fairness", "least_loaded", fairness["ours"], fairness["least_loaded"],
                 better="higher", ndigits=3)
    if quiet_ttft["ours"] > 0:
        report.ratio("quiet_ttft_p50", "least_loaded", quiet_ttft["ours"],
                     quiet_ttft["least_loaded"], better="lower", ndigits=3)
    report.print_ratios("fair shares", {"fairness_vs_least_loaded": "(target >= 1)"})
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
