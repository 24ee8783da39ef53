"""A flooding tenant and quiet ones, each a pool of closed-loop clients, against any OpenAI URL,
and what each tenant saw.

The goodput benchmark drives our gateway and Dynamo's frontend with it alike. Each tenant is
a pool of clients that send its API key (``Authorization: Bearer <tenant>-key``; a frontend
without tenants ignores it, so the tenants are then just separate client pools). Each client
sends one-turn chats of ``prompt_words`` random words (one word is one token with the shared
WordLevel model), each asking for exactly ``max_tokens``, one after another with no think
time, for ``warmup_s`` and then ``duration_s``. Counted: the requests that finished within
the ``duration_s`` after the warm-up, whenever they were sent, each as an ``Outcome`` of
``_chat_load`` (TTFT, the gaps between content chunks, tokens). So the counts are rates over
one window for every tenant: counting only requests sent after the warm-up would drop more of
a tenant whose requests take longer (a queued flooder's), at the window's start. A failed
request is counted as such, and its client sends the next at once.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import aiohttp
from _chat_load import ChatResult, Outcome, chat_request, words

__all__ = ["FloodLoad", "Tenant", "jain", "run_flood_load"]


@dataclass(frozen=True)
class FloodLoad:
    tenants: tuple[tuple[str, int], ...]  # (name, clients), the flooding tenant first
    prompt_words: int
    max_tokens: int
    warmup_s: float
    duration_s: float
    vocab: int = 32000


@dataclass
class Tenant:
    """One tenant's counted requests over one or more runs of ``duration_s`` each."""

    name: str
    clients: int
    outcomes: list[Outcome] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def tokens(self) -> int:
        """Tokens served: prompt and completion, of the requests that succeeded."""
        return sum(o.prompt_tokens + o.completion_tokens for o in self.outcomes if o.ok)

    def result(self) -> ChatResult:
        return ChatResult(self.outcomes, self.duration_s, self.errors)

    @classmethod
    def pooled(cls, runs: list[Tenant]) -> Tenant:
        """One tenant's runs as one: every request, the runs' durations added up."""
        first = runs[0]
        return cls(first.name, first.clients, [o for t in runs for o in t.outcomes],
                   [e for t in runs for e in t.errors], sum(t.duration_s for t in runs))


def jain(values: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2)."""
    total, squares = sum(values), sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else 0.0


async def _client(session: aiohttp.ClientSession, url: str, tenant: Tenant, seed: int,
                  counted_from: float, until: float, load: FloodLoad) -> None:
    rng = random.Random(seed)
    while time.perf_counter() < until:
        prompt = [{"role": "user", "content": words(rng, load.prompt_words, load.vocab)}]
        errors: list[str] = []
        outcome, _ = await chat_request(session, url, "tiny", prompt, load.max_tokens, errors)
        finished = time.perf_counter()
        if finished > until:
            break  # finished after the window: not counted, for any stack
        if finished < counted_from:
            continue  # finished during the warm-up
        tenant.outcomes.append(outcome)
        tenant.errors.extend(errors)


async def _drive(url: str, load: FloodLoad) -> list[Tenant]:
    tenants = [Tenant(name, clients, duration_s=load.duration_s)
               for name, clients in load.tenants]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    counted_from = time.perf_counter() + load.warmup_s
    until = counted_from + load.duration_s
    sessions = [aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
        headers={"authorization": f"Bearer {t.name}-key"}) for t in tenants]
    try:
        await asyncio.gather(*(
            _client(session, url, t, i * 1000 + c, counted_from, until, load)
            for i, (t, session) in enumerate(zip(tenants, sessions, strict=True))
            for c in range(t.clients)))
    finally:
        for session in sessions:
            await session.close()
    return tenants


def run_flood_load(url: str, load: FloodLoad) -> list[Tenant]:
    """Drive ``load`` against ``url`` for its warm-up and duration; each tenant's requests."""
    return asyncio.run(_drive(url, load))
