"""vllm-router's kv_aware policy fed by our sidecars' republished events, against its own
round robin: the prefix-cache hit rate on a shared-prefix chat load (#31.6).

Reference engines (simulated compute, a small KV pool each, SGLang's KV events) each get a
sidecar that republishes their events in vLLM's ZMQ format (``--publish-zmq``, sha256_cbor).
One pass runs vllm-router ``--policy kv_aware`` with the sidecars as its static event sources,
one ``--policy round_robin``, and one ``kv_aware`` whose sources are silent PUB sockets (what
its own speculative index entries achieve without our events); each pass starts fresh
engines and drives the same
request sequence: ``--groups`` long system prompts, each request one of them (seeded random
choice) with its own question, ``--concurrency`` in flight. The hit rate is what the engines
report: the sum of ``usage.prompt_tokens_details.cached_tokens`` over the sum of prompt
tokens. Each pool holds a little over half the prefixes, so an engine that sees every
prefix (round robin) evicts what it will need again, and one that keeps its own share
(kv_aware, if the events steer it) does not.

Ratios: ``vllm_router_kv_aware_via_sidecar_hit_rate_vs_round_robin`` (the target: >= 1.3) and
``..._vs_kv_aware_without_events`` (higher is better).
Needs vllm-router (``pip install -e '.[peers]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path

import aiohttp
import zmq
from benchkit import Report, add_json_flag, print_table, progress

from kvsidecar.local_stack import EngineSpec, LocalStack, StackSpec
from kvsidecar.local_vllm_router import VllmRouter, vllm_router_binary

TOPICS = ["astronomy", "baking", "chess", "databases", "ecology", "finance", "geology",
          "history", "immunology", "jazz", "knitting", "linguistics"]


def system_prompt(group: int, words: int) -> str:
    topic = TOPICS[group % len(TOPICS)]
    body = " ".join(f"{topic}-rule-{group}-{i}" for i in range(words))
    return f"You are the {topic} assistant #{group}. Follow these rules: {body}."


def requests(groups: int, count: int, words: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    systems = [system_prompt(g, words) for g in range(groups)]
    return [(systems[rng.randrange(groups)], f"Question {i}: what about case {rng.random():.6f}?")
            for i in range(count)]


def fleet_spec(engines: int, kv_tokens: int) -> StackSpec:
    """Simulated engines in one process, each with a sidecar (``r<i>``) republishing its
    events in vLLM's format; no gateway: vllm-router is the router."""
    republish = ("--publish-zmq", "tcp://127.0.0.1:*", "--publish-zmq-replay",
                 "tcp://127.0.0.1:*")
    return StackSpec(engines=(EngineSpec(replicas=engines,
                                         worker_ids=tuple(f"r{i}" for i in range(engines)),
                                         sidecar_args=republish),),
                     gateways=(), speedup=20, max_total_tokens=kv_tokens)


def republished(stack: LocalStack) -> dict[str, tuple[str, str | None]]:
    """Each engine's URL → the (events, replay) endpoints its sidecar republishes on."""
    engines = stack.engine_urls
    fleet = {}
    for sidecar in stack.sidecars:
        published = sidecar.ready["zmq_publish"][sidecar.worker_id]
        fleet[engines[sidecar.worker_id]] = (published["endpoint"], published["replay_endpoint"])
    return fleet


async def drive(url: str, load: list[tuple[str, str]], concurrency: int) -> dict[str, float]:
    """Send ``load`` through the router; what the engines said they had cached."""
    queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
    for item in load:
        queue.put_nowait(item)
    totals = {"prompt_tokens": 0.0, "cached_tokens": 0.0, "requests": 0.0}

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            system, user = queue.get_nowait()
            body = {"model": "tiny", "max_tokens": 4, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": user}]}
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"router answered {resp.status}: {await resp.text()}")
                usage = (await resp.json())["usage"]
            totals["prompt_tokens"] += usage["prompt_tokens"]
            totals["cached_tokens"] += (usage.get("prompt_tokens_details") or {}).get(
                "cached_tokens") or 0
            totals["requests"] += 1

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return totals


PASSES = {"kv_aware": ("kv_aware", True), "round_robin": ("round_robin", False),
          "kv_aware_without_events": ("kv_aware", False)}


def run_pass(
    name: str, args: argparse.Namespace, load: list[tuple[str, str]]
) -> dict[str, float]:
    policy, events = PASSES[name]
    ctx = zmq.Context()
    silent = []
    with tempfile.TemporaryDirectory(prefix=f"bench-vllm-router-{name}-") as tmp, \
            LocalStack(fleet_spec(args.engines, args.kv_tokens), Path(tmp)) as stack:
        workdir = Path(tmp)
        fleet = republished(stack)
        if policy == "kv_aware" and not events:  # sources that never say anything
            for url in fleet:
                sock = ctx.socket(zmq.PUB)
                sock.bind("tcp://127.0.0.1:*")
                silent.append(sock)
                fleet[url] = (sock.getsockopt_string(zmq.LAST_ENDPOINT), None)
        router = VllmRouter.start(workdir, f"vllm-router-{name}", fleet, policy=policy)
        try:
            router.wait_ready()
            progress(f"{name}: {len(load)} requests over {args.engines} engines")
            totals = asyncio.run(drive(router.url, load, args.concurrency))
        finally:
            router.stop()
            for sock in silent:
                sock.close(linger=0)
            ctx.term()
    totals["hit_rate"] = totals["cached_tokens"] / totals["prompt_tokens"]
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8, help="shared system prompts")
    parser.add_argument("--words", type=int, default=40, help="rule words per system prompt")
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kv-tokens", type=int, default=3072,
                        help="each engine's KV pool, in tokens (--max-total-tokens)")
    parser.add_argument("--seed", type=int, default=0)
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.engines < 2:
        parser.error("--engines must be >= 2: a router over one engine has nothing to choose")
    if vllm_router_binary() is None:
        parser.error("vllm-router is not installed (pip install -e '.[peers]')")
    load = requests(args.groups, args.requests, args.words, args.seed)
    report = Report()
    passes = {name: run_pass(name, args, load) for name in PASSES}
    for name, totals in passes.items():
        report.add_figures(totals, prefix=f"vllm_router_{name}_")
    for baseline in ("round_robin", "kv_aware_without_events"):
        report.ratio("vllm_router_kv_aware_via_sidecar_hit_rate", baseline,
                     passes["kv_aware"]["hit_rate"], passes[baseline]["hit_rate"],
                     better="higher", ndigits=3)
    print(f"{args.engines} engines, {args.kv_tokens} KV tokens each; {args.groups} system "
          f"prompts, {args.requests} chats, {args.concurrency} in flight")
    print_table(
        ["vllm-router pass", "requests", "prompt tokens", "cached tokens", "hit rate"],
        [[name, t["requests"], t["prompt_tokens"], t["cached_tokens"], t["hit_rate"]]
         for name, t in passes.items()],
    )
    report.print_ratios("kv_aware via our sidecars")
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
