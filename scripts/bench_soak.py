#!/usr/bin/env python3
"""Soak: concurrent streams through two gateway replicas while an engine, a sidecar and a
gateway are each killed and restarted; requests lost, memory growth, TTFT before/during/after.

The fleet, all real processes on loopback started by ``kvsidecar.local_stack``: a
``nats-server`` (JetStream), ``--engines`` simulated reference engines (one process each, so a
killed one is restarted alone, on its ports), a sidecar beside each, and two gateways
(``--nats``, ``--migration-limit``, ``--drain-timeout-s``). ``--streams`` clients each run
multi-turn chats (``--groups`` shared system prompts) in a closed loop for ``--duration-s``,
request i of a client going to gateway i mod 2, as a round-robin balancer would; a request
that cannot reach a gateway (refused, or its connection closed before any byte) is sent to
the other one, as a balancer would retry, and a stopping gateway is out of rotation until
its ``/health`` says ready again.

The faults, at fractions of the run (each process restarted ``--down-s`` later):
engine 0 SIGKILLed at 0.2 (its streams migrate), sidecar 1 SIGKILLed at 0.4 (its streams
migrate), gateway 0 stopped with SIGTERM at 0.6 (a rolling restart: it drains its streams).
*Before* is the run up to the first fault, *during* up to ``--settle-s`` after the last
restart, *after* the rest. Where the restarts run late (a slow or busy machine), the run goes
on past ``--duration-s`` until *after* has had a fifth of it, so no phase is ever empty.

A request is *ok* when its stream ends with ``[DONE]``, *refused* when a gateway answered an
error status (429/503 under overload: a clear answer, not a loss), *lost* when its stream was
cut after it began. Memory: the resident size of the processes that were never restarted, at
the end of *before* and at the end of the run.

Prints a table; ``--json FILE`` writes ``{"figures": {...}, "ratios": {...}}``, the ratios
comparing *after* with *before* of the same run (>= 1: recovered): ``ttft_p99_after_vs_before``,
``ttft_p50_after_vs_before``.
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
from benchkit import ROOT, Report, add_json_flag, progress

from kvsidecar.launch import ManagedProcess
from kvsidecar.local_stack import EngineSpec, GatewaySpec, LocalStack, StackSpec

MODEL = ROOT / "refengine" / "models" / "tiny"
WORDS = ["cache", "token", "prefix", "block", "engine", "gateway", "replica", "memory",
         "placement", "request", "session", "worker", "stream", "answer", "context", "model"]
PHASES = ("before", "during", "after")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Slot:
    """One process of the fleet, restarted in place by ``LocalStack.restart``."""

    name: str
    proc: ManagedProcess
    restarts: int = 0


class Fleet:
    def __init__(self, tmp: Path, args: argparse.Namespace) -> None:
        spec = StackSpec(
            # one process per engine, so that one can be killed and restarted on its ports
            engines=tuple(EngineSpec(worker_ids=(f"w{i}",)) for i in range(args.engines)),
            gateways=(GatewaySpec(
                count=2, seed=0, health_check_interval_s=0.5, wait_routable=False,
                args=("--migration-limit", str(args.migration_limit), "--drain-timeout-s",
                      "60", "--upstream-timeout-s", "30")),),
            model_path=str(MODEL), max_total_tokens=args.cache_tokens, speedup=args.speedup,
            log_level="warning", nats=True,
        )
        self.stack = LocalStack(spec, tmp).start()
        self.engines = [Slot(f"engine-{i}", p.proc) for i, p in enumerate(self.stack.engines)]
        self.sidecars = [Slot(f"sidecar-{i}", p.proc) for i, p in enumerate(self.stack.sidecars)]
        self.gateways = [Slot(f"gateway-{g}", p.proc) for g, p in enumerate(self.stack.gateways)]

    @property
    def gateway_urls(self) -> list[str]:
        return [self.url_of(s) for s in self.gateways]

    @staticmethod
    def url_of(slot: Slot) -> str:
        return slot.proc.url

    def restart(self, slot: Slot) -> None:
        slot.restarts += 1
        slot.proc = self.stack.restart(slot.proc)

    def stable(self) -> list[Slot]:
        """The processes never restarted (so far)."""
        return [s for s in (*self.engines, *self.sidecars, *self.gateways) if not s.restarts]

    def stop(self) -> None:
        self.stack.stop()


@dataclass
class Outcome:
    t: float  # start, seconds into the run
    kind: str  # ok, lost, refused
    ttft_s: float | None = None
    status: int = 200


@dataclass
class Run:
    t0: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    failovers: int = 0  # requests sent to the other gateway before any byte
    faults: list[tuple[float, str]] = field(default_factory=list)
    first_fault: float = float("inf")
    recovered: float = float("inf")
    ended: float = float("inf")  # when the clients were told to stop
    rss_before: dict[str, float] = field(default_factory=dict)
    rss_samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    stop: bool = False
    verbose: bool = False
    # Gateways the balancer sends nothing to: from their SIGTERM until they are ready again
    # (their /health answers 200 once their workers are routable), as its health check would.
    out_of_rotation: set[str] = field(default_factory=set)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def phase(self, t: float) -> str:
        return "before" if t < self.first_fault else "during" if t < self.recovered else "after"


def _text(rng: random.Random, words: int) -> str:
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(100)}" for _ in range(words))


async def _one(session: aiohttp.ClientSession, urls: list[str], first: int,
               messages: list[dict[str, str]], max_tokens: int, run: Run) -> str:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    t = run.now()
    for attempt in range(len(urls) * 2):
        url = urls[(first + attempt) % len(urls)]
        if url in run.out_of_rotation:
            continue
        started = time.monotonic()
        ttft: float | None = None
        parts: list[str] = []
        headed = done = False
        try:
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                headed = True
                if resp.status != 200:
                    error = await resp.read()
                    run.outcomes.append(Outcome(t, "refused", status=resp.status))
                    if run.verbose:
                        print(f"  {run.now():6.1f}s  {resp.status} {error[:200]!r}",
                              file=sys.stderr)
                    return ""
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    if line.strip() == b"data: [DONE]":
                        done = True
                        break
                    if ttft is None:
                        ttft = time.monotonic() - started
                    chunk = json.loads(line[5:])
                    parts += [(c.get("delta") or {}).get("content") or ""
                              for c in chunk.get("choices") or ()]
        except aiohttp.ClientError:
            if not headed:  # nothing came back: a balancer sends it elsewhere
                run.failovers += 1
                await asyncio.sleep(0.05 * attempt)
                continue
        run.outcomes.append(Outcome(t, "ok" if done else "lost", ttft))
        return "".join(parts)
    run.outcomes.append(Outcome(t, "refused"))
    return ""


async def _client(i: int, urls: list[str], args: argparse.Namespace, systems: list[str],
                  run: Run, session: aiohttp.ClientSession) -> None:
    rng = random.Random(args.seed * 1000 + i)
    sent = i
    while not run.stop:
        messages = [{"role": "system", "content": rng.choice(systems)}]
        for _ in range(args.turns):
            if run.stop:
                return
            messages.append({"role": "user", "content": _text(rng, args.user_words)})
            reply = await _one(session, urls, sent, messages, args.max_tokens, run)
            sent += 1
            messages.append({"role": "assistant", "content": reply})


async def _faults(fleet: Fleet, args: argparse.Namespace, run: Run) -> None:
    plan = ((0.2, fleet.engines[0], "kill"), (0.4, fleet.sidecars[1 % len(fleet.sidecars)],
            "kill"), (0.6, fleet.gateways[0], "stop"))
    for at, slot, how in plan:
        await asyncio.sleep(max(0.0, at * args.duration_s - run.now()))
        if not run.rss_before:
            run.rss_before = {s.name: rss_mib(s.proc.proc.pid) for s in fleet.stable()
                              if s.proc is not None}
            run.first_fault = run.now()
        assert slot.proc is not None
        run.faults.append((run.now(), f"{slot.name} {'SIGKILL' if how == 'kill' else 'SIGTERM'}"))
        print(f"  {run.now():6.1f}s  {run.faults[-1][1]}", file=sys.stderr, flush=True)
        gateway = fleet.url_of(slot) if slot in fleet.gateways else None
        if gateway is not None:  # its /health says draining from the SIGTERM on
            run.out_of_rotation.add(gateway)
        if how == "kill":
            await asyncio.to_thread(slot.proc.kill)
        else:
            await asyncio.to_thread(slot.proc.stop, 90)
        await asyncio.sleep(args.down_s)
        await asyncio.to_thread(fleet.restart, slot)
        if gateway is not None:
            async with aiohttp.ClientSession() as session:
                while await _routable(session, gateway) < len(fleet.engines):
                    await asyncio.sleep(0.1)
            run.out_of_rotation.discard(gateway)
        run.faults.append((run.now(), f"{slot.name} back"))
        print(f"  {run.now():6.1f}s  {slot.name} back", file=sys.stderr, flush=True)
    run.recovered = run.now() + args.settle_s


async def _sample_rss(fleet: Fleet, args: argparse.Namespace, run: Run) -> None:
    """The resident size of every process that was never restarted, ten times a run."""
    while not run.stop:
        await asyncio.sleep(args.duration_s / 10)
        sizes = {}
        for slot in fleet.stable():
            if slot.proc is not None and slot.proc.proc.poll() is None:
                sizes[slot.name] = rss_mib(slot.proc.proc.pid)
        run.rss_samples.append((run.now(), sizes))


async def _routable(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(f"{url}/v1/workers") as resp:
        return sum(bool(w["routable"]) for w in (await resp.json())["workers"])


async def _metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


async def soak(fleet: Fleet, args: argparse.Namespace) -> tuple[Run, dict[str, float]]:
    rng = random.Random(args.seed)
    systems = [_text(rng, args.system_words) for _ in range(args.groups)]
    run = Run(verbose=args.verbose)
    urls = fleet.gateway_urls
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=90)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for url in urls:
            while await _routable(session, url) < len(fleet.engines):
                await asyncio.sleep(0.1)
        run.t0 = time.monotonic()
        faults = asyncio.create_task(_faults(fleet, args, run))
        sampler = asyncio.create_task(_sample_rss(fleet, args, run))
        clients = [asyncio.create_task(_client(i, urls, args, systems, run, session))
                   for i in range(args.streams)]
        await asyncio.sleep(args.duration_s)
        await faults
        await asyncio.sleep(max(0.0, run.recovered + args.duration_s / 5 - run.now()))
        run.stop = True
        run.ended = run.now()
        await asyncio.gather(*clients)
        sampler.cancel()
        counts = {name: sum([await _metric(session, url, f"kvsidecar_gateway_{name}_total")
                             for url in urls]) for name in ("migrations", "streams_lost")}
    return run, counts


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def report(run: Run, counts: dict[str, float], rss_after: dict[str, float],
           args: argparse.Namespace) -> Report:
    print(f"\n{args.streams} streams for {run.ended:.0f} s through 2 gateways "
          f"(--migration-limit {args.migration_limit}), {args.engines} simulated engines\n")
    for t, what in run.faults:
        print(f"  {t:6.1f} s  {what}")
    print("\n| phase | requests | ok | lost | refused | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    out = Report()
    for phase in (*PHASES, "all"):
        mine = [o for o in run.outcomes if phase == "all" or run.phase(o.t) == phase]
        ttfts = [o.ttft_s for o in mine if o.ttft_s is not None]
        n = {k: sum(o.kind == k for o in mine) for k in ("ok", "lost", "refused")}
        p50, p99 = _quantile(ttfts, 0.5), _quantile(ttfts, 0.99)
        print(f"| {phase} | {len(mine)} | {n['ok']} | {n['lost']} | {n['refused']} | "
              f"{p50 * 1e3:.1f} | {p99 * 1e3:.1f} |")
        out.add_figures({f"{phase}_requests": len(mine), f"{phase}_lost": n["lost"],
                         f"{phase}_refused": n["refused"]})
        if ttfts:  # else no stream of this phase got a token: no TTFT to report
            out.add_figures({f"{phase}_ttft_p50_s": p50, f"{phase}_ttft_p99_s": p99})
    statuses: dict[int, int] = {}
    for o in run.outcomes:
        if o.kind == "refused":
            statuses[o.status] = statuses.get(o.status, 0) + 1
    print(f"\nrefusals by status: {dict(sorted(statuses.items())) or 'none'}")
    out.add_figures({f"refused_{code}": n for code, n in statuses.items()})
    print(f"sent to the other gateway before any byte: {run.failovers}; streams migrated: "
          f"{counts['migrations']:.0f}; cut by the gateways: {counts['streams_lost']:.0f} "
          "(the restarted gateway counts from its restart)")
    out.add_figures({"failovers": run.failovers, "migrations": counts["migrations"],
                     "gateway_streams_lost": counts["streams_lost"]})
    # Growth over the last third of the run tells a leak (still growing) from caches and
    # allocator arenas that filled up under the faults' extra load (flat by then).
    late = [sizes for t, sizes in run.rss_samples if t >= run.ended * 2 / 3]
    print("\n| process (never restarted) | RSS before MiB | RSS end MiB | growth | growth in "
          "the last third |")
    print("|---|---:|---:|---:|---:|")
    for name, after in rss_after.items():
        before = run.rss_before[name]
        third = late[0].get(name, after) if late else after
        print(f"| {name} | {before:.1f} | {after:.1f} | {(after - before) / before:+.1%} | "
              f"{(after - third) / third:+.1%} |")
        out.figure(f"{name}_rss_growth", (after - before) / before)
        out.figure(f"{name}_rss_growth_last_third", (after - third) / third)
    fig = out.figures
    for q in ("p99", "p50"):
        if f"after_ttft_{q}_s" in fig and f"before_ttft_{q}_s" in fig:
            out.ratio(f"ttft_{q}_after", "before", fig[f"after_ttft_{q}_s"],
                      fig[f"before_ttft_{q}_s"], better="lower")
    out.print_ratios("after the faults")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Method and figures: docs/bench/soak.md.")
    p.add_argument("--streams", type=int, default=200, help="concurrent clients (default 200)")
    p.add_argument("--duration-s", type=float, default=600.0, help="default 600")
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--cache-tokens", type=int, default=32768, help="each engine's KV cache")
    p.add_argument("--speedup", type=float, default=2.0, help="of the simulated engines")
    p.add_argument("--groups", type=int, default=8, help="system prompts shared by clients")
    p.add_argument("--system-words", type=int, default=200)
    p.add_argument("--user-words", type=int, default=30)
    p.add_argument("--turns", type=int, default=4, help="turns before a client starts over")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--migration-limit", type=int, default=2)
    p.add_argument("--down-s", type=float, default=10.0, help="a killed process's downtime")
    p.add_argument("--settle-s", type=float, default=15.0,
                   help="after the last restart, still 'during' (default 15)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--verbose", action="store_true", help="print each refusal as it comes")
    p.add_argument("--quick", action="store_true",
                   help="24 streams for 60 s, 3 s downtimes (a smoke run)")
    add_json_flag(p)
    args = p.parse_args(argv)
    if args.quick:
        args.streams, args.duration_s, args.down_s, args.settle_s = 24, 60.0, 3.0, 5.0
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        progress("starting the fleet ...")
        fleet = Fleet(Path(tmp), args)
        try:
            progress(f"soaking for {args.duration_s:.0f} s ...")
            run, counts = asyncio.run(soak(fleet, args))
            rss_after = {s.name: rss_mib(s.proc.proc.pid) for s in fleet.stable()
                         if s.proc is not None}
        finally:
            fleet.stop()
    out = report(run, counts, rss_after, args)
    if args.json:
        out.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
