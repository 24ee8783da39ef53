#!/usr/bin/env python3
"""Benchmark what users feel: goodput under TTFT and ITL targets, against Dynamo, and each
tenant's share when one floods (issue #32).

``--load hot``: two hot system prompts of 4,000 tokens, 384 one-turn sessions, 64 in flight,
4 simulated workers of 2,048 KV blocks. ``--load capacity``: capacity-bound multi-turn chat,
40 system prompts of 2,000 tokens, 1,024 blocks a worker, 384 sessions of 2 turns, 64 in
flight. Each turn adds 64 user tokens and streams exactly 64 (``scripts/_chat_load.py``).
Each runs, on a fresh stack each time, through:

* ``ours``: sim reference engines (``refengine --compute sim``) with the mocker's step model
  and timing (``--sim-model mocker --enable-mixed-chunk --share-in-flight-prefill``: each
  step runs every decoding request plus prompt chunks up to 8,192 batched tokens and lasts
  the mocker's polynomial for that batch; a prefix being computed is reused, not computed
  again), a sidecar each, one gateway in kv mode with every mechanism on;
* ``prefill_only``: the same with ``--decode-interference-weight 0`` (the cost before #32:
  prefill and held blocks only), to show what the decode-interference term buys;
* on the capacity load, ``capped``: ``ours`` behind a gateway admission cap
  (``--max-in-flight-per-worker 12``, the rest queued), which this load needed while the
  engines' health probes queued behind their work, its queue placing by prefix
  (``--queue-lookahead``); and ``capped_fifo``: the same with ``--queue-lookahead 0`` (the
  queue's head to the first worker that frees);
* ``dynamo`` (unless ``--peers none``): Dynamo 1.6.1's frontend (kv router) and mockers with
  the same block size, KV capacity, batch limits and speed (``../shared/bench/dynamo/``;
  ``setup_dynamo.sh`` builds its venv under ``~/.cache/kvsidecar-bench`` when absent).

Before the counted load each stack gets the same warm-up (``--warmup-requests`` unrelated
one-turn chats, a ramp up to 16 in flight): a serving stack has seen traffic before a load
arrives, and our gateway's online fits learn from it. Figures per stack: requests, failures,
requests/s, goodput (requests whose TTFT is within ``--slo-ttft-ms`` and whose mean ITL is
within ``--slo-itl-ms``, per second), TTFT p50/p99, ITL p50/p99 (every gap between streamed
chunks), prefix-cache hit rate (cached over prompt tokens, from the replies' usage).
Ratios (>= 1 better): ``goodput_vs_dynamo_<load>``, ``ttft_p99_vs_dynamo_<load>``,
``itl_p50_vs_dynamo_<load>``, ``hit_rate_vs_dynamo_<load>``, and the same against
``prefill_only_<load>`` and ``capped_<load>``; ``queue_lookahead_hit_rate_vs_capped_fifo_<load>``
compares the two capped stacks. ``--stacks`` runs a subset of ours.

Each request's mean ITL is also split at the mocker model's full-KV decode step (no step
without prompt tokens is longer): the part up to it, the part beyond it (prompt chunks mixed
into the step, and the stack's own delay), the share of gaps carrying a prompt chunk, and
the prompt tokens computed per second (figures ``itl_mean_ms``, ``itl_to_floor_ms``,
``itl_over_floor_ms``, ``gaps_with_prefill_share``, ``computed_prompt_tokens_per_s``).

``--repeats N`` runs every stack N times on fresh stacks, interleaved (a drift of the machine
hits each alike), and pools the requests for the figures. With N >= 2 it prints each stack's
single-run range and sd (relative to the pooled figure) of the figures with targets, and each
ratio's standard error with each run's own ratio (figures ``<load>.<stack>.<figure>_run_sd``
and ``<ratio>_se``, computed as ``bench_replicas.py`` does, ``benchkit.ratio_se``): one run's
figures move by several percent with timing alone.

``--load flood``: three tenants (``flood``, ``quiet-a``, ``quiet-b``) send one-turn chats
(``--prompt-words`` random words, exactly ``--flood-max-tokens`` out;
``scripts/_flood_load.py``) to a fleet of ``--flood-workers`` x ``--slots``, for
``--warmup-s`` and then ``--duration-s``, on fresh stacks each. ``--flood-arrivals open``
(the default) overloads it, as in the VTC paper (Sheng et al., "Fairness in Serving Large
Language Models"): each tenant sends at its own rate, Poisson arrivals from a seeded RNG (the
same schedule and prompts for every stack), each request on schedule whatever the replies:
the flooder at ``--flood-rate`` (40 req/s at speedup 1, ~1.7x the default fleet's capacity C
of ~24 req/s, measured by the closed loop: 24.4 ours, 26.2 Dynamo's), each quiet tenant at
``--quiet-rate`` (5 req/s, ~0.2 C, below its third). Counted: the requests sent in the
window, each followed to its end: sent = served + shed (429 or 503, with the reason header
and ``retry-after`` kept) + failed. ``--flood-arrivals closed`` runs closed loops instead
(``--flood-clients`` 32 and ``--quiet-clients`` 4 each, no think time; counted: the requests
that finished in the window): a closed loop never has more waiting than its clients, so it
shows who orders a backlog, not overload. Three stacks:

* ``ours``: our gateway (least-loaded; the tenants are API keys of its ``--api-key-file``,
  weight 1 each) admitting ``--slots`` requests a worker and queueing the rest by the
  tenants' fair shares (``--queue-order fair``), a request that waited ``--queue-timeout-s``
  shed with 503 ``queue_timeout`` and ``retry-after`` (default: open loop, the TTFT target,
  fixed before the run: a request still waiting when its target has passed has missed it;
  closed loop, 120 s), in front of sim engines stepping as the mocker (the same engine flags
  as the other loads, and at most ``--slots`` running requests), ``--blocks`` KV blocks each
  (default 1,024);
* ``least_loaded``: the same gateway, flags and timeout, its queue first come, first served
  (``fcfs``: what a least-loaded router with a queue gives);
* ``dynamo`` (unless ``--peers none``): Dynamo 1.6.1's frontend (kv router) and as many
  mockers, each running at most ``--slots`` requests (``--max-num-seqs``; the rest wait in the
  mocker's own queue, first come first served, without bound), the same blocks, token budget
  and speed. It has no tenants: the clients send the same Authorization header, which it
  ignores, so the tenants are just separate streams.

Goodput uses the same targets as the other loads, fixed before the run (``--slo-ttft-ms``
500 and ``--slo-itl-ms`` 50 at speedup 1, divided by ``--speedup``): the counted requests
served within both, per second of the window. Per stack, every tenant's counted requests
pooled, as on the other loads: sent, served (``requests``), shed (``quiet_shed``: the quiet
tenants'), failed, goodput, TTFT p50/p99 and ITL p50/p99 of those served, the quiet tenants'
TTFT p99 apart (``quiet_ttft_p99_ms``), the requests and tokens served *in* the window
(``req_per_s``, ``tokens_per_s``, whenever sent). Per tenant: sent, served, shed (and by
reason), failed, tokens served in the window, its share and its entitlement, goodput, TTFT
p50/p99. Fairness (``_flood_load.fairness``): Jain's index over each tenant's tokens served in
the window divided by its max-min fair allocation of the fleet's tokens served in the window;
a tenant's demand is what it sent in the window (a closed loop's tenants are backlogged: an
equal split), so a quiet tenant asking less than a third is entitled to all it asks and the
flooder to the rest. 1 when every tenant got its allocation, toward 1/n as they depart from
it. Shedding the flooder's excess is the point; shedding a quiet tenant's request is a
failure, and each stack's table says which happened. No hit rate ratio: prompts of random
words share no prefix. Ratios: ``fairness_vs_least_loaded``, ``quiet_ttft_p50_vs_least_loaded``,
and against each of ``dynamo`` and ``least_loaded``: ``goodput_vs_<stack>_flood``,
``ttft_p99_vs_<stack>_flood``, ``itl_p50_vs_<stack>_flood``, ``quiet_ttft_p99_vs_<stack>_flood``;
``fairness_vs_dynamo_flood``. A baseline with no good request at all gets a goodput ratio
against one request in its window (a lower bound, marked by the figure
``goodput_vs_<stack>_flood_is_lower_bound``). ``--repeats`` applies as on the other loads.

``--load all`` runs all three. ``--json FILE`` writes ``{"figures": {...}, "ratios": {...}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
from _chat_load import ChatLoad, ChatResult, run_chat, warm_up
from _flood_load import FloodLoad, Tenant, TenantLoad, fairness, run_flood_load
from benchkit import (
    ROOT,
    Better,
    Report,
    add_json_flag,
    format_value,
    print_table,
    print_values,
    progress,
    ratio_se,
    run_spread,
)

from kvsidecar.local_stack import EngineSpec, GatewaySpec, LocalStack, StackSpec
from refengine.timing import SimModel, TimingModel

MODEL = ROOT / "refengine" / "models" / "tiny"
TENANTS = ("flood", "quiet-a", "quiet-b")
# Our gateway's two queue orders on the flood: each tenant's fair share, first come first served
FLOOD_STACKS = (("ours", "fair"), ("least_loaded", "fcfs"))


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


# --- the goodput loads, against Dynamo --------------------------------------------------

BENCH_HOME = Path(os.environ.get("BENCH_HOME") or Path(
    os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvsidecar-bench")
DYNAMO_DIR = ROOT.parent / "shared" / "bench" / "dynamo"
CHAT_LOADS = {
    "hot": (ChatLoad(system_prompts=2, system_tokens=4000, sessions=384, turns=1,
                     concurrency=64), 2048),
    "capacity": (ChatLoad(system_prompts=40, system_tokens=2000, sessions=384, turns=2,
                          concurrency=64), 1024),
}
BLOCK_SIZE = 16  # tokens a KV block, on both stacks (our --page-size, the mocker's block)
FLOOD_BLOCKS = 1024  # KV blocks a worker on the flood: its prompts share nothing, and fit
# Our stacks per load: each a name and its gateway's flags. ``ours`` has every mechanism on,
# ``prefill_only`` the decode-interference term off. On the capacity load, also the gateway
# admission cap the load needed before the engines' health answered from their progress
# (``capped``: --max-in-flight-per-worker 12, the queue placing by prefix) and the same with
# the queue placing its head on the first worker that frees (``capped_fifo``).
_CAP = ("--max-in-flight-per-worker", "12", "--queue-timeout-s", "600")
OURS = {
    "hot": (("ours", ()), ("prefill_only", ("--decode-interference-weight", "0"))),
    "capacity": (("ours", ()), ("prefill_only", ("--decode-interference-weight", "0")),
                 ("capped", _CAP), ("capped_fifo", (*_CAP, "--queue-lookahead", "0"))),
}
# Our sim engine as the mocker: its step model (one mixed batch a step under a budget of
# 8,192 batched tokens), its timing polynomial, its batch limit.
MOCKER_TIMING = ("--sim-model", "mocker", "--enable-mixed-chunk", "--share-in-flight-prefill",
                 "--chunked-prefill-size", "8192", "--max-running-requests", "256")


def free_port() -> int:
    """A port for Dynamo's frontend (its script takes a number; ours bind port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def targets(args: argparse.Namespace) -> tuple[float, float]:
    """The TTFT and ITL targets in seconds at the run's ``--speedup``."""
    return (args.slo_ttft_ms / 1000 / args.speedup, args.slo_itl_ms / 1000 / args.speedup)


def run_ours(name: str, extra: tuple[str, ...], load: ChatLoad, blocks: int,
             args: argparse.Namespace, tmp: Path) -> tuple[ChatResult, dict[str, float]]:
    """``load`` through our stack with ``extra`` gateway flags; the result and what the
    gateway learned."""
    spec = StackSpec(
        engines=(EngineSpec(replicas=args.workers, args=(
            "--served-model-name", "tiny", "--page-size", str(BLOCK_SIZE), *MOCKER_TIMING)),),
        gateways=(GatewaySpec(args=(
            "--served-model-name", "tiny", "--slo-ttft-ms", f"{targets(args)[0] * 1000:g}",
            "--slo-itl-ms", f"{targets(args)[1] * 1000:g}", *extra)),),
        model_path=str(args.model_dir), max_total_tokens=blocks * BLOCK_SIZE, speedup=args.speedup,
        log_level="warning",
    )
    stack = LocalStack(spec, tmp / name).start()
    try:
        url = stack.url
        warm_up(url, "tiny", args.warmup_requests, 16)
        before = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
        result = run_chat(url, "tiny", load)
        after = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
        scorer = _get_json(f"{url}/v1/workers")["scorer"]
    finally:
        stack.stop()
    def grew(name: str) -> float:
        return _metric(after, name) - _metric(before, name)

    reason = 'kvsidecar_gateway_placement_reason_total{reason="%s"}'
    learned = {
        "interference_placements": grew(reason % "interference"),
        # every placement the decode term sent elsewhere, a new prefix's included
        "decode_moves": grew("kvsidecar_gateway_decode_interference_moves_total"),
        # placed off a deeper holder because it was at the admission cap
        "capacity_placements": grew(reason % "capacity"),
        "queue_for_prefix": grew("kvsidecar_gateway_admission_for_prefix_total"),
        "prefill_load_scale": round(scorer["prefill_load_scale"], 3),
        "overlap_weight": round(scorer["overlap_weight"], 3),
    }
    decode = scorer.get("decode_interference") or {}
    if decode.get("priced"):
        learned["itl_base_ms"] = round(decode["fleet_itl_base_s"] * 1e3, 3)
        learned["itl_per_stream_ms"] = round(decode["fleet_itl_per_stream_s"] * 1e3, 3)
    return result, learned


def ensure_dynamo(args: argparse.Namespace) -> Path:
    """Dynamo's venv (built by its setup script when absent); its python."""
    python = BENCH_HOME / "dynamo-venv" / "bin" / "python"
    if not (BENCH_HOME / "dynamo-venv" / ".ready").exists():
        progress("building Dynamo's venv (setup_dynamo.sh, about a minute)")
        subprocess.run([str(args.dynamo_dir / "setup_dynamo.sh")], check=True,
                       env={**os.environ, "BENCH_HOME": str(BENCH_HOME)})
    return python


@contextmanager
def dynamo_stack(workers: int, blocks: int, max_seqs: int, args: argparse.Namespace,
                 tmp: Path) -> Iterator[str]:
    """Dynamo's frontend (kv router) and ``workers`` mockers of ``blocks`` KV blocks each,
    at most ``max_seqs`` requests in a mocker's batch (the rest wait in its queue), at the
    run's speed; its URL while it runs."""
    state = tmp / "dynamo"
    env = {**os.environ, "BENCH_HOME": str(BENCH_HOME), "STATE_DIR": str(state),
           "PORT": str(free_port()), "ROUTER_MODE": "kv", "NUM_WORKERS": str(workers),
           "NUM_GPU_BLOCKS": str(blocks), "BLOCK_SIZE": str(BLOCK_SIZE),
           "SPEEDUP": f"{args.speedup:g}",
           "MAX_NUM_SEQS": str(max_seqs), "MAX_BATCHED_TOKENS": "8192",
           "MODEL_DIR": str(args.model_dir)}
    try:
        started = subprocess.run([str(args.dynamo_dir / "dynamo_stack.sh")], env=env,
                                 capture_output=True, text=True, timeout=300)
        if started.returncode != 0:
            raise RuntimeError(f"Dynamo's stack did not start: {started.stderr[-2000:]}")
        yield started.stdout.strip().splitlines()[-1]
    finally:
        subprocess.run([str(args.dynamo_dir / "stop_dynamo_stack.sh")], env=env,
                       capture_output=True, timeout=120)


def run_dynamo(load: ChatLoad, blocks: int, args: argparse.Namespace,
               tmp: Path) -> ChatResult:
    """``load`` through Dynamo's frontend (kv router) and mockers."""
    with dynamo_stack(args.workers, blocks, 256, args, tmp) as url:
        warm_up(url, "tiny", args.warmup_requests, 16)
        return run_chat(url, "tiny", load)


def flood_load(args: argparse.Namespace) -> FloodLoad:
    """The flood's tenants: open loop, each at its rate (at speedup 1, times ``--speedup``);
    closed loop, each with its clients."""
    open_loop = args.flood_arrivals == "open"
    return FloodLoad(
        tenants=tuple(TenantLoad(name, clients=0 if open_loop else clients,
                                 rate=rate * args.speedup if open_loop else 0.0)
                      for name, clients, rate in zip(
                          TENANTS, (args.flood_clients, args.quiet_clients, args.quiet_clients),
                          (args.flood_rate, args.quiet_rate, args.quiet_rate), strict=True)),
        open_loop=open_loop, prompt_words=args.prompt_words, max_tokens=args.flood_max_tokens,
        warmup_s=args.warmup_s, duration_s=args.duration_s)


def flood_queue_timeout_s(args: argparse.Namespace) -> float:
    """Our gateways' ``--queue-timeout-s`` on the flood: ``--queue-timeout-s`` when given;
    else in an open loop the TTFT target (a request still waiting when its target has passed
    has missed it: it is shed, 503 with retry-after, rather than served late), in a closed
    loop 120 s (nothing needs shedding: the clients wait)."""
    if args.queue_timeout_s is not None:
        return float(args.queue_timeout_s)
    return targets(args)[0] if args.flood_arrivals == "open" else 120.0


def run_flood_ours(order: str, args: argparse.Namespace, tmp: Path) -> list[Tenant]:
    """The flood through our gateway with its queue in ``order``, in front of sim engines
    with the mocker's timing, each running at most ``--slots`` requests as the gateway
    admits; each tenant's requests."""
    workdir = tmp / order
    workdir.mkdir(parents=True)
    keys = workdir / "keys.txt"
    keys.write_text("".join(f"{t}-key {t} weight=1\n" for t in TENANTS))
    spec = StackSpec(
        # plain workers without KV events, no sidecars: the gateway's queue is measured
        engines=(EngineSpec(replicas=args.flood_workers, sidecars=False, args=(
            "--served-model-name", "tiny", "--page-size", str(BLOCK_SIZE), *MOCKER_TIMING,
            "--max-running-requests", str(args.slots))),),
        gateways=(GatewaySpec(
            router_mode="least-loaded", workers="engines", health_check_interval_s=10.0,
            wait_routable=False,  # below, with an API key
            args=("--served-model-name", "tiny", "--api-key-file", str(keys),
                  "--max-in-flight-per-worker", str(args.slots),
                  "--queue-timeout-s", f"{flood_queue_timeout_s(args):g}",
                  "--queue-order", order)),),
        model_path=str(args.model_dir), max_total_tokens=flood_blocks(args) * BLOCK_SIZE,
        speedup=args.speedup, events_config='{"publisher": "null"}', log_level="warning")
    with LocalStack(spec, workdir) as stack:
        asyncio.run(wait_routable(stack.url, args.flood_workers))
        return run_flood_load(stack.url, flood_load(args))


def run_flood_dynamo(args: argparse.Namespace, tmp: Path) -> list[Tenant]:
    """The flood through Dynamo's frontend and mockers of ``--slots`` requests a batch."""
    with dynamo_stack(args.flood_workers, flood_blocks(args), args.slots, args, tmp) as url:
        return run_flood_load(url, flood_load(args))


def flood_blocks(args: argparse.Namespace) -> int:
    return int(args.blocks or FLOOD_BLOCKS)


_RATIOS: tuple[tuple[str, Better], ...] = (
    ("goodput_req_per_s", "higher"), ("ttft_p99_ms", "lower"), ("itl_p50_ms", "lower"),
    ("hit_rate", "higher"))
_SPREAD = tuple(figure for figure, _ in _RATIOS)  # the figures with targets
_COLUMNS = ("requests", "failed", "req_per_s", "goodput_req_per_s", "goodput_share",
            "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "hit_rate",
            "busiest_worker_share")


# What the gateway learned, per run: counts add up over runs, fitted values are averaged.
_COUNTS = ("interference_placements", "decode_moves", "capacity_placements",
           "queue_for_prefix")


def pool_learned(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = dict.fromkeys(k for run in runs for k in run)
    return {k: sum(run.get(k, 0.0) for run in runs) if k in _COUNTS
            else round(statistics.fmean(run[k] for run in runs if k in run), 3) for k in keys}


def decode_floor_s(speedup: float) -> float:
    """The longest pure decode step of the mocker's model (the KV read at the pool's size):
    no step without prompt tokens lasts longer, on our engine or Dynamo's mocker."""
    model = TimingModel(speedup=speedup, shape=SimModel.MOCKER)
    return model.step((), (), yields=True, kv_attended=1.0)


def goodput_ceiling_req_per_s(load: ChatLoad, workers: int, blocks: int,
                              speedup: float) -> float:
    """The most requests per second any router could serve on ``load`` under the mocker's
    step price: an upper bound on every stack's goodput, whatever it places where.

    Every request streams exactly ``max_tokens``, each token yielded by a step whose decode
    part is priced by the contexts its yielding requests read, summed, over the pool
    (``TimingModel.step_parts``). A worker decoding ``n`` requests makes ``n`` tokens per
    step, so its rate is ``n / decode(n·c / pool)``, and the fleet's is that summed over the
    workers; over any span the rate is at most the best split's. The bound takes every
    request at the shortest context any has while decoding (its first turn's system and user
    tokens), every prompt computed for free (no prefill part, no step without a token), at
    most ``concurrency`` in flight, and the best split of them over the workers, found
    exactly (a knapsack over the workers). Optimistic in each of those, so no placement,
    admission or queueing policy beats it."""
    model = TimingModel(speedup=speedup, shape=SimModel.MOCKER)
    context = load.system_tokens + load.user_tokens
    pool_tokens = blocks * BLOCK_SIZE

    def rate(n: int) -> float:  # tokens per second of one worker decoding n requests
        if n == 0:
            return 0.0
        return n / model.step((), (), yields=True, kv_attended=n * context / pool_tokens)

    best = [0.0] * (load.concurrency + 1)  # best[m]: the fleet's rate with m in flight
    for _ in range(workers):
        best = [max(best[m - n] + rate(n) for n in range(m + 1))
                for m in range(load.concurrency + 1)]
    return max(best) / load.max_tokens


def itl_split(result: ChatResult, speedup: float) -> dict[str, float]:
    """Each request's mean gap between streamed chunks (the ITL goodput judges), split at the
    decode floor: the part of each gap up to it, and the part beyond it (prompt chunks
    computed in the same step, and the stack's own delay); both averaged over requests.
    With the share of gaps that carry a prompt chunk (longer than the floor by more than half
    the smallest prefill part) and the prompt tokens computed per second (not cached)."""
    floor_s = decode_floor_s(speedup)
    least_prefill_s = TimingModel(speedup=speedup, shape=SimModel.MOCKER).step(
        ((1, 1),), (), yields=False, kv_attended=0.0)
    ok = [o for o in result.outcomes if o.ok and o.gaps_s]
    n = len(ok) or 1
    to_floor = sum(sum(min(g, floor_s) for g in o.gaps_s) / len(o.gaps_s) for o in ok) / n
    over = sum(sum(max(0.0, g - floor_s) for g in o.gaps_s) / len(o.gaps_s) for o in ok) / n
    gaps = [g for o in ok for g in o.gaps_s]
    with_prefill = sum(g > floor_s + least_prefill_s / 2 for g in gaps)
    computed = sum(o.prompt_tokens - o.cached_tokens for o in result.outcomes if o.ok)
    return {
        "itl_mean_ms": round((to_floor + over) * 1e3, 2),
        "itl_to_floor_ms": round(to_floor * 1e3, 2),
        "itl_over_floor_ms": round(over * 1e3, 2),
        "gaps_with_prefill_share": round(with_prefill / len(gaps), 4) if gaps else 0.0,
        "computed_prompt_tokens_per_s": round(computed / (result.wall_s or 1e-9), 1),
    }


@dataclass
class StackRuns:
    """One stack's runs of one load: each run's result, and what its gateway learned."""

    results: list[ChatResult] = field(default_factory=list)
    learned: list[dict[str, float]] = field(default_factory=list)

    def add(self, result: ChatResult, name: str, learned: dict[str, float] | None = None,
            ) -> None:
        self.results.append(result)
        if learned is not None:
            self.learned.append(learned)
        if result.errors:
            progress(f"{name}: {len(result.errors)} errors, e.g. {result.errors[:2]}")


def run_chat_load(name: str, args: argparse.Namespace, report: Report, tmp: Path) -> None:
    load, blocks = CHAT_LOADS[name]
    load = replace(load, **{k: v for k, v in (
        ("sessions", args.sessions), ("concurrency", args.concurrency),
        ("system_tokens", args.system_tokens), ("max_tokens", args.max_tokens)) if v})
    blocks = args.blocks or blocks
    ttft_s, itl_s = targets(args)
    gateway_args = tuple(shlex.split(args.gateway_args or ""))
    stacks = OURS[name] if args.stacks is None else [
        (system, extra) for system, extra in OURS[name] if system in args.stacks]
    runs: dict[str, StackRuns] = {}
    n = args.repeats
    for repeat in range(n):  # interleaved: a drift of the machine hits every stack alike
        of = f" ({repeat + 1}/{n})" if n > 1 else ""
        for system, extra in stacks:
            progress(f"{name}: {system}{of} ({load.sessions} sessions x {load.turns} turns)")
            result, fitted = run_ours(system, (*gateway_args, *extra), load, blocks, args,
                                      tmp / name / f"{repeat}")
            runs.setdefault(system, StackRuns()).add(result, f"{name}: {system}", fitted)
        if args.peers == "dynamo":
            progress(f"{name}: dynamo{of}")
            result = run_dynamo(load, blocks, args, tmp / name / f"{repeat}")
            runs.setdefault("dynamo", StackRuns()).add(result, f"{name}: dynamo")
    rows = {system: ChatResult.pooled(r.results).summary(ttft_s, itl_s)
            for system, r in runs.items()}
    learned = {system: pool_learned(r.learned) for system, r in runs.items() if r.learned}
    print(f"\n{name}: {load.system_prompts} system prompts x {load.system_tokens} tokens, "
          f"{load.sessions} sessions x {load.turns} turns, {load.concurrency} in flight, "
          f"{args.workers} workers x {blocks} blocks, speedup {args.speedup:g}; targets "
          f"TTFT {ttft_s * 1000:g} ms, ITL {itl_s * 1000:g} ms; our gateways: "
          f"{' '.join(gateway_args) or 'defaults'}, and per stack: " + "; ".join(
              f"{system} {' '.join(extra) or '(none)'}" for system, extra in stacks)
          + (f"; {n} runs of each, pooled" if n > 1 else ""))
    print_table(["stack", *_COLUMNS], [[system, *(row.get(c) for c in _COLUMNS)]
                                       for system, row in rows.items()])
    for system, values in learned.items():
        print(f"  {system} learned: " + ", ".join(f"{k}={v:g}" for k, v in values.items()))
    ceiling = goodput_ceiling_req_per_s(load, args.workers, blocks, args.speedup)
    report.figure(f"{name}.goodput_ceiling_req_per_s", round(ceiling, 4))
    line = (f"  ceiling: no router serves more than {ceiling:.3f} req/s on this load under the "
            f"mocker's step price (every prompt free, the {load.concurrency} in flight at "
            "their cheapest split over the workers)")
    dynamo = rows.get("dynamo")
    if dynamo and dynamo["goodput_req_per_s"] > 0:
        over = ceiling / dynamo["goodput_req_per_s"]
        report.figure(f"{name}.goodput_ceiling_over_dynamo", round(over, 4))
        line += f": {over:.3f}x Dynamo's goodput"
    print(line)
    for system, row in rows.items():
        if row["failed"]:
            print(f"  WARNING: {system}: {row['failed']:g} requests failed; its figures cover "
                  "the rest, its goodput counts them as missed")
    floor_s = decode_floor_s(args.speedup)
    split = {system: itl_split(ChatResult.pooled(r.results), args.speedup)
             for system, r in runs.items()}
    print(f"\n{name}: each request's mean ITL split at the decode floor ({floor_s * 1e3:.1f} ms, "
          "the KV read at the pool's size): up to it, and beyond it (prompt chunks in the "
          "step, delay)")
    columns = list(next(iter(split.values()), {}))
    print_table(["stack", *columns], [[system, *row.values()] for system, row in split.items()])
    for system, row in rows.items():
        report.add_figures(row, prefix=f"{name}.{system}.")
        report.add_figures(split[system], prefix=f"{name}.{system}.")
    for system, values in learned.items():
        report.add_figures(values, prefix=f"{name}.{system}.")
    single = {system: [r.summary(ttft_s, itl_s) for r in stack.results]
              for system, stack in runs.items()}
    spread = {system: {figure: run_spread([run[figure] for run in single[system]],
                                          rows[system][figure]) for figure in _SPREAD}
              for system in runs}
    if n > 1:
        print(f"\n{name}: single runs, min-max (sd relative to the pooled figure):")
        print_table(["stack", *_SPREAD], [[system, *(
            f"{format_value(min(run[f] for run in single[system]))}-"
            f"{format_value(max(run[f] for run in single[system]))} "
            f"({spread[system][f]:.3f})" for f in _SPREAD)] for system in runs])
        for system in runs:
            report.add_figures({f"{f}_run_sd": round(v, 4) for f, v in spread[system].items()},
                               prefix=f"{name}.{system}.")
    capped, fifo = rows.get("capped"), rows.get("capped_fifo")
    if capped is not None and fifo is not None and fifo["hit_rate"] > 0:
        report.ratio("queue_lookahead_hit_rate", f"capped_fifo_{name}", capped["hit_rate"],
                     fifo["hit_rate"], better="higher", ndigits=3)
    compare(report, name, rows, single, ("dynamo", "prefill_only", "capped"), _RATIOS)


def compare(report: Report, load: str, rows: dict[str, dict[str, float]],
            single: dict[str, list[dict[str, float]]], baselines: tuple[str, ...],
            ratios: tuple[tuple[str, Better], ...]) -> None:
    """Each of ``ratios``' figures of ``ours`` against each of ``baselines`` that ran, from
    the pooled ``rows`` (``<figure>_vs_<baseline>_<load>``). With several runs (``single``:
    each run's row), each ratio's standard error and each run's own ratio too."""
    ours = rows.get("ours")
    n = len(single.get("ours", ()))
    errors: dict[str, str] = {}
    for baseline in baselines:
        theirs = rows.get(baseline)
        if theirs is None or ours is None:
            continue
        for figure, better in ratios:
            short = figure.removesuffix("_req_per_s").removesuffix("_ms")
            value = theirs[figure]
            lower_bound = figure == "goodput_req_per_s" and value == 0 < ours[figure]
            if lower_bound:
                # the baseline met no target: against one request over its runs, a lower bound
                value = 1 / theirs["wall_s"]
                report.figure(f"{short}_vs_{baseline}_{load}_is_lower_bound", 1)
                print(f"  {load}: {baseline} met no target; goodput_vs_{baseline}_{load} "
                      f"counts it as 1 request in {theirs['wall_s']:g}s (a lower bound)")
            if not (ours[figure] > 0 and value > 0):
                print(f"  {load}: no {figure} ratio against {baseline}: ours "
                      f"{ours[figure]:g}, {baseline} {value:g}")
                continue
            ratio = report.ratio(short, f"{baseline}_{load}", ours[figure], value,
                                 better=better, ndigits=3)
            if n > 1 and not lower_bound:  # a bound has no spread
                ratio_name = f"{short}_vs_{baseline}_{load}"
                se = ratio_se(ratio, *(run_spread([run[figure] for run in single[stack]],
                                                  rows[stack][figure])
                                       for stack in ("ours", baseline)), n)
                report.figure(f"{ratio_name}_se", round(se, 4))
                per_run = [Report().ratio(short, "run", a[figure], b[figure], better=better,
                                          ndigits=3)
                           for a, b in zip(single["ours"], single[baseline], strict=True)
                           if a[figure] > 0 and b[figure] > 0]
                errors[ratio_name] = (f"+- {se:.3f}  (runs: "
                                      f"{', '.join(f'{r:.3f}' for r in per_run)})")
    if errors:
        print(f"\n{load}: ratios of the pooled runs, their standard error over {n} runs and "
              "each run's own:")
        print_values("standard errors", {k: report.ratios[k] for k in errors}, digits=3,
                     notes=errors)


def flood_row(tenants: list[Tenant], ttft_s: float, itl_s: float,
              open_loop: bool) -> dict[str, float]:
    """One stack's flood figures: every tenant's counted requests pooled
    (``ChatResult.summary``: ``requests`` are those served, ``goodput_share`` the good ones
    among those sent), with the requests sent, shed and failed apart (all tenants', the
    flooder's and the quiet tenants'), the quiet tenants' TTFT p50 and p99, Jain's index
    (``_flood_load.fairness``), and the service in the window (``req_per_s``,
    ``tokens_per_s``: requests and tokens served in it, whenever sent)."""
    duration = tenants[0].duration_s or 1e-9
    every = ChatResult([o for t in tenants for o in t.outcomes], duration,
                       [e for t in tenants for e in t.errors]).summary(ttft_s, itl_s)
    quiet = ChatResult([o for t in tenants[1:] for o in t.outcomes], duration, []).summary(
        ttft_s, itl_s)
    flood_sent = len(tenants[0].outcomes)
    quiet_sent = sum(len(t.outcomes) for t in tenants[1:])
    return {**every,
            "sent": flood_sent + quiet_sent,
            "shed": sum(t.shed for t in tenants),
            "failed": sum(t.failed for t in tenants),
            "flood_shed": tenants[0].shed,
            "flood_shed_share": round(tenants[0].shed / flood_sent, 4) if flood_sent else 0.0,
            "quiet_shed": sum(t.shed for t in tenants[1:]),
            "quiet_shed_share": round(sum(t.shed for t in tenants[1:]) / quiet_sent, 4)
            if quiet_sent else 0.0,
            "req_per_s": round(sum(t.window_requests for t in tenants) / duration, 3),
            "quiet_ttft_p50_ms": quiet["ttft_p50_ms"],
            "quiet_ttft_p99_ms": quiet["ttft_p99_ms"],
            "jain_index": round(fairness(tenants, open_loop)[0], 4),
            "tokens_per_s": round(sum(t.window_tokens for t in tenants) / duration, 1)}


_FLOOD_COLUMNS = ("sent", "requests", "shed", "quiet_shed", "failed", "req_per_s",
                  "goodput_req_per_s", "goodput_share", "ttft_p50_ms", "ttft_p99_ms",
                  "quiet_ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "jain_index", "tokens_per_s")
# Pooled over every tenant, as on the other loads; the quiet tenants' TTFT p99 beside it (a
# fair queue trades the flooder's waits for theirs). No hit rate: the prompts share nothing.
_FLOOD_RATIOS: tuple[tuple[str, Better], ...] = (
    ("goodput_req_per_s", "higher"), ("ttft_p99_ms", "lower"), ("itl_p50_ms", "lower"),
    ("quiet_ttft_p99_ms", "lower"))


def print_flood_tenants(name: str, tenants: list[Tenant], open_loop: bool, ttft_s: float,
                        itl_s: float, report: Report) -> None:
    """One stack's table of tenants, its refusals by reason, and whom it shed."""
    order = dict(FLOOD_STACKS).get(name)
    print(f"\n{name}" + (f" (our gateway, --queue-order {order}):" if order else
                          " (Dynamo's frontend, kv router, and mockers):"))
    _, shares = fairness(tenants, open_loop)
    served = sum(t.window_tokens for t in tenants) or 1
    rows = [(t, t.result().summary(ttft_s, itl_s)) for t in tenants]
    print_table(["tenant", "load", "sent", "served", "shed", "failed", "tokens", "share",
                 "entitled", "goodput/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms"],
                [[t.name, f"{t.rate:g}/s" if open_loop else f"{t.clients} clients",
                  len(t.outcomes), t.served, t.shed, t.failed, t.window_tokens,
                  round(t.window_tokens / served, 3), round(share / served, 3),
                  row["goodput_req_per_s"], row["ttft_p50_ms"], row["ttft_p99_ms"],
                  row["itl_p50_ms"]] for (t, row), share in zip(rows, shares, strict=True)])
    for t, row in rows:
        report.add_figures({"sent": len(t.outcomes), "shed": t.shed, "failed": t.failed,
                            "tokens": t.window_tokens}, prefix=f"flood.{name}.{t.name}.")
        report.add_figures({k: row[k] for k in ("requests", "goodput_req_per_s",
                                                 "ttft_p50_ms", "ttft_p99_ms")},
                           prefix=f"flood.{name}.{t.name}.")
        if t.errors:
            progress(f"flood: {name}: {t.name}: {len(t.errors)} failed, e.g. {t.errors[:2]}")
        if t.shed:
            print(f"  {t.name} shed: " + ", ".join(
                f"{n} x {reason}" for reason, n in sorted(t.shed_reasons().items())))
    flood, quiet = tenants[0], tenants[1:]
    quiet_shed = sum(t.shed for t in quiet)
    if not any(t.shed for t in tenants):
        print("  shed nothing")
    elif quiet_shed:
        print(f"  FAILED to protect the quiet tenants: {quiet_shed} of their "
              f"{sum(len(t.outcomes) for t in quiet)} requests shed (the flooder: "
              f"{flood.shed} of {len(flood.outcomes)})")
    else:
        print(f"  shed only the flooder's excess: {flood.shed} of its {len(flood.outcomes)} "
              "requests, none of the quiet tenants'")


def run_flood(args: argparse.Namespace, report: Report, tmp: Path) -> None:
    ttft_s, itl_s = targets(args)
    load = flood_load(args)
    runs: dict[str, list[list[Tenant]]] = {}
    n = args.repeats
    for repeat in range(n):  # interleaved, as the other loads
        of = f" ({repeat + 1}/{n})" if n > 1 else ""
        for name, order in FLOOD_STACKS:
            progress(f"flood: {name} (--queue-order {order}){of} for {args.duration_s:g}s")
            runs.setdefault(name, []).append(run_flood_ours(order, args, tmp / f"{repeat}"))
        if args.peers == "dynamo":
            progress(f"flood: dynamo{of} for {args.duration_s:g}s")
            runs.setdefault("dynamo", []).append(run_flood_dynamo(args, tmp / f"{repeat}"))
    pooled = {name: [Tenant.pooled(list(t)) for t in zip(*stack_runs, strict=True)]
              for name, stack_runs in runs.items()}
    if load.open_loop:
        arrivals = (f"open loop, Poisson arrivals: {TENANTS[0]} {load.tenants[0].rate:g} req/s, "
                    f"{', '.join(TENANTS[1:])} {load.tenants[1].rate:g} req/s each")
    else:
        arrivals = (f"closed loops: {TENANTS[0]} {args.flood_clients} clients, "
                    f"{', '.join(TENANTS[1:])} {args.quiet_clients} clients each")
    print(f"\nflood: {args.flood_workers} simulated workers x {args.slots} slots x "
          f"{flood_blocks(args)} blocks, mocker timing, speedup {args.speedup:g}; {arrivals}; "
          f"all weight 1; one-turn chats of {args.prompt_words} random words, "
          f"{args.flood_max_tokens} tokens out; {args.duration_s:g}s counted after "
          f"{args.warmup_s:g}s; targets TTFT {ttft_s * 1000:g} ms, ITL {itl_s * 1000:g} ms; "
          f"our gateways --queue-timeout-s {flood_queue_timeout_s(args):g}"
          + (f"; {n} runs of each, pooled" if n > 1 else ""))
    for name, tenants in pooled.items():
        print_flood_tenants(name, tenants, load.open_loop, ttft_s, itl_s, report)
    rows = {name: flood_row(tenants, ttft_s, itl_s, load.open_loop)
            for name, tenants in pooled.items()}
    print("\nflood, every tenant's requests pooled (requests: served; req_per_s, tokens_per_s: "
          "served in the window; quiet_ttft_p99_ms: the quiet tenants'):")
    print_table(["stack", *_FLOOD_COLUMNS], [[name, *(row.get(c) for c in _FLOOD_COLUMNS)]
                                             for name, row in rows.items()])
    for name, row in rows.items():
        report.add_figures(row, prefix=f"flood.{name}.")
        report.figure(f"flood.{name}.quiet_ttft_p50_s", round(row["quiet_ttft_p50_ms"] / 1e3, 4))
    ours, fcfs = rows["ours"], rows["least_loaded"]
    report.ratio("fairness", "least_loaded", ours["jain_index"], fcfs["jain_index"],
                 better="higher", ndigits=3)
    if ours["quiet_ttft_p50_ms"] > 0:
        report.ratio("quiet_ttft_p50", "least_loaded", ours["quiet_ttft_p50_ms"],
                     fcfs["quiet_ttft_p50_ms"], better="lower", ndigits=3)
    if "dynamo" in rows:
        report.ratio("fairness", "dynamo_flood", ours["jain_index"], rows["dynamo"]["jain_index"],
                     better="higher", ndigits=3)
    single = {name: [flood_row(tenants, ttft_s, itl_s, load.open_loop)
                     for tenants in stack_runs] for name, stack_runs in runs.items()}
    compare(report, "flood", rows, single, ("dynamo", "least_loaded"), _FLOOD_RATIOS)


_TARGETS = {"fairness_vs_least_loaded": "(target >= 1)"}
for _load in (*CHAT_LOADS, "flood"):
    _TARGETS |= {f"goodput_vs_dynamo_{_load}": "(target >= 1.2)",
                 f"ttft_p99_vs_dynamo_{_load}": "(target >= 1)",
                 f"itl_p50_vs_dynamo_{_load}": "(target >= 1)"}
_TARGETS["hit_rate_vs_dynamo_hot"] = "(target >= 0.99)"
_TARGETS["hit_rate_vs_prefill_only_capacity"] = "(target >= 1: today's hit rate)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", choices=["hot", "capacity", "flood", "all"], default="all")
    c = p.add_argument_group("every load")
    c.add_argument("--peers", choices=["dynamo", "none"], default="dynamo",
                   help="dynamo: run Dynamo's frontend + mocker too; none: our stacks only")
    c.add_argument("--speedup", type=float, default=1.0,
                   help="divide every simulated duration, ours and the mocker's")
    c.add_argument("--slo-ttft-ms", type=float, default=500.0,
                   help="the TTFT target at speedup 1 (divided by --speedup)")
    c.add_argument("--slo-itl-ms", type=float, default=50.0,
                   help="the ITL target at speedup 1 (divided by --speedup)")
    c.add_argument("--blocks", type=int,
                   help=f"KV blocks a worker, instead of the load's (flood: {FLOOD_BLOCKS})")
    c.add_argument("--repeats", type=int, default=1,
                   help="runs of each stack on fresh stacks, interleaved and pooled; with 2 or "
                   "more, each stack's single-run spread and each ratio's standard error")
    c.add_argument("--model-dir", type=Path,
                   help="the model both stacks serve (default: Dynamo's one-word-one-token "
                   "tinymodel under ~/.cache/kvsidecar-bench; with --peers none and no such "
                   "directory, refengine/models/tiny)")
    c.add_argument("--dynamo-dir", type=Path, default=DYNAMO_DIR,
                   help="the scripts that run Dynamo's CPU stack")
    g = p.add_argument_group("hot and capacity loads")
    g.add_argument("--workers", type=int, default=4)
    g.add_argument("--warmup-requests", type=int, default=128)
    g.add_argument("--sessions", type=int, help="instead of the load's")
    g.add_argument("--concurrency", type=int, help="instead of the load's")
    g.add_argument("--system-tokens", type=int, help="instead of the load's")
    g.add_argument("--max-tokens", type=int, help="instead of the load's 64")
    g.add_argument("--gateway-args", metavar="FLAGS",
                   help="more flags (one string) for every one of our gateways")
    g.add_argument("--stacks", nargs="+", metavar="NAME",
                   help="only these of our stacks (ours, prefill_only; capacity: capped, "
                   "capped_fifo)")
    f = p.add_argument_group("flood load")
    f.add_argument("--flood-workers", type=int, default=2)
    f.add_argument("--slots", type=int, default=4, help="requests in flight per worker")
    f.add_argument("--flood-arrivals", choices=["open", "closed"], default="open",
                   help="open: each tenant sends at its rate whatever the replies (Poisson, "
                   "seeded); closed: each tenant's clients send one after another")
    f.add_argument("--flood-rate", type=float, default=40.0,
                   help="open loop: the flooding tenant's requests/s at speedup 1 (times "
                   "--speedup); the default is ~1.7x the default fleet's ~24 req/s")
    f.add_argument("--quiet-rate", type=float, default=5.0,
                   help="open loop: each quiet tenant's requests/s at speedup 1 (times "
                   "--speedup); the default is ~0.2x the default fleet's ~24 req/s")
    f.add_argument("--flood-clients", type=int, default=32, help="closed loop")
    f.add_argument("--quiet-clients", type=int, default=4, help="closed loop: each")
    f.add_argument("--prompt-words", type=int, default=200)
    f.add_argument("--flood-max-tokens", type=int, default=32)
    f.add_argument("--warmup-s", type=float, default=3.0,
                   help="of each ordering's run, before requests are counted")
    f.add_argument("--duration-s", type=float, default=20.0,
                   help="of each ordering's run, counted")
    f.add_argument("--queue-timeout-s", type=float,
                   help="our gateways' (both queue orders alike); default: open loop, the "
                   "TTFT target (--slo-ttft-ms / --speedup); closed loop, 120")
    add_json_flag(p)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    loads = ["hot", "capacity", "flood"] if args.load == "all" else [args.load]
    if args.model_dir is None:
        shared = BENCH_HOME / "tinymodel"
        args.model_dir = shared if args.peers == "dynamo" or shared.is_dir() else MODEL
    if args.peers == "dynamo":
        if not (args.dynamo_dir / "dynamo_stack.sh").is_file():
            p.error(f"--peers dynamo: no Dynamo scripts in {args.dynamo_dir} (--dynamo-dir, "
                    "or --peers none)")
        ensure_dynamo(args)
    report = Report()
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp:
        for load in loads:
            if load == "flood":
                run_flood(args, report, Path(tmp) / "flood")
            else:
                run_chat_load(load, args, report, Path(tmp))
    report.print_ratios("ours", {k: v for k, v in _TARGETS.items() if k in report.ratios})
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
