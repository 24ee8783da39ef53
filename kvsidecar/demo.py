"""The demo workload of ``kvsidecar up --demo``: multi-turn chats sharing system prompts.

Chosen so that placement matters, as in a fleet whose caches are full: more conversations
than one replica's KV cache holds (``kvsidecar up --demo`` sizes each replica's KV pool to
``DEMO_KV_TOKENS``), so a policy that keeps each conversation where its history is cached
hits, and one that spreads its turns over the replicas evicts what the next turn needs.

Each policy runs the same conversations against the same engines, with the engines' caches
flushed in between, so the hit rates, TTFTs and throughputs compare placement and nothing
else. Hit rate is what the engines report: cached prompt tokens over prompt tokens, from
``usage``.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

__all__ = ["DEMO_KV_TOKENS", "DemoResult", "run_demo"]

DEMO_KV_TOKENS = 16384  # each replica's KV pool in the demo: a few conversations' worth
_SYSTEM_PROMPTS = 8
_SYSTEM_WORDS = 400
_TURNS = 4
_TURN_WORDS = 300
_THINK_S = (0.1, 0.4)  # between a reply and the next turn

_WORDS = (
    "cache",
    "token",
    "prefix",
    "block",
    "engine",
    "gateway",
    "replica",
    "memory",
    "route",
    "decode",
    "prefill",
    "latency",
    "batch",
    "model",
    "page",
    "event",
)


@dataclass(frozen=True, slots=True)
class DemoResult:
    policy: str
    requests: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    workers_used: int
    requests_per_s: float


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _conversations(count: int, seed: int = 3) -> list[tuple[str, list[str]]]:
    rng = random.Random(seed)
    systems = [f"You are assistant {i}. " + _text(rng, _SYSTEM_WORDS)
               for i in range(_SYSTEM_PROMPTS)]
    return [(systems[i % len(systems)], [_text(rng, _TURN_WORDS) for _ in range(_TURNS)])
            for i in range(count)]


async def _chat(
    session: aiohttp.ClientSession, url: str, model: str, messages: list[dict[str, str]]
) -> tuple[str, float, int, int, str]:
    """(reply, TTFT s, prompt tokens, cached tokens, worker) of one streamed chat request."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    t0 = time.monotonic()
    ttft = 0.0
    reply: list[str] = []
    usage: dict[str, Any] = {}
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"demo request failed: {resp.status} {await resp.text()}")
        worker = resp.headers.get("x-kvsidecar-worker", "?")
        async for line in resp.content:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            if not ttft:
                ttft = time.monotonic() - t0
            chunk = orjson.loads(line[5:])
            reply.extend(
                (choice.get("delta") or {}).get("content") or ""
                for choice in chunk.get("choices") or ()
            )
            usage = chunk.get("usage") or usage
    details: dict[str, Any] = usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0)
    return "".join(reply), ttft, int(usage.get("prompt_tokens") or 0), cached, worker


async def _run_policy(
    name: str, url: str, model: str, conversations: int, concurrency: int
) -> DemoResult:
    ttfts: list[float] = []
    prompt = cached = 0
    workers: set[str] = set()
    gate = asyncio.Semaphore(concurrency)

    think = random.Random(7)

    async def converse(session: aiohttp.ClientSession, system: str, turns: list[str]) -> None:
        nonlocal prompt, cached
        async with gate:
            messages = [{"role": "system", "content": system}]
            for i, turn in enumerate(turns):
                if i:  # the user reads the reply and types: other sessions' turns come between
                    await asyncio.sleep(think.uniform(*_THINK_S))
                messages.append({"role": "user", "content": turn})
                reply, ttft, p, c, worker = await _chat(session, url, model, messages)
                messages.append({"role": "assistant", "content": reply})
                ttfts.append(ttft)
                prompt += p
                cached += c
                workers.add(worker)

    started = time.monotonic()
    async with aiohttp.ClientSession() as session, asyncio.TaskGroup() as tg:
        for system, turns in _conversations(conversations):
            tg.create_task(converse(session, system, turns))
    wall = time.monotonic() - started
    ttfts.sort()
    return DemoResult(
        name,
        len(ttfts),
        cached / prompt if prompt else 0.0,
        statistics.median(ttfts) * 1e3,
        ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] * 1e3,
        len(workers),
        len(ttfts) / wall,
    )


async def _flush(engine_urls: list[str]) -> None:
    async with aiohttp.ClientSession() as session:
        for url in engine_urls:
            async with session.post(f"{url}/flush_cache") as resp:
                await resp.read()


async def run_demo(
    gateways: dict[str, str],
    engine_urls: list[str],
    model: str,
    conversations: int = 32,
    concurrency: int = 8,
) -> list[DemoResult]:
    """Run the workload once per gateway (policy name → URL), flushing caches in between."""
    results = []
    for name, url in gateways.items():
        await _flush(engine_urls)
        results.append(await _run_policy(name, url, model, conversations, concurrency))
    return results
