"""A flooding tenant and quiet ones against any OpenAI URL, and what each tenant saw.

The goodput benchmark drives our gateway and Dynamo's frontend with it alike. Each tenant
sends its API key (``Authorization: Bearer <tenant>-key``; a frontend without tenants ignores
it, so the tenants are then just separate streams of requests). Every request is a one-turn
chat of ``prompt_words`` random words (one word is one token with the shared WordLevel
model) asking for exactly ``max_tokens``. Two ways to drive it:

* **Open loop** (``TenantLoad.rate``), as in the VTC paper (Sheng et al., "Fairness in
  Serving Large Language Models", OSDI 2024): each tenant sends at its own rate, Poisson
  arrivals from a seeded RNG, so every stack gets the same schedule and the same prompts.
  Each request is sent on schedule, whatever the replies to earlier ones, as its own task,
  for ``warmup_s`` and then ``duration_s``. Counted: the requests *sent* in the
  ``duration_s`` window, each followed to its end however long that takes, so for every
  tenant sent = served + shed + failed. Served: a 200 that streamed content; shed: a 429 or
  503 (``Outcome.shed``; its ``x-kvsidecar-shed-reason`` and ``retry-after`` are kept);
  failed: anything else. A closed loop cannot overload anything: it never has more requests
  waiting than clients. An open loop at more than the fleet's rate does, and then the
  stack must queue without bound or refuse.
* **Closed loop** (``TenantLoad.clients``): each tenant is a pool of clients, each sending
  its next request when the last ends, no think time. Counted: the requests that finished
  in the window, whenever sent (counting by send time would drop more of a tenant whose
  requests wait longer, at the window's start).

Both also count each tenant's service *in* the window (``window_tokens``: prompt and
completion tokens of the requests that finished successfully in it, whenever sent), which is
what ``fairness`` judges: the share of the fleet's work each tenant got while the load lasted.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
from _chat_load import ChatResult, Outcome, chat_request, words

__all__ = ["FloodLoad", "Tenant", "TenantLoad", "fairness", "jain", "max_min_shares",
           "run_flood_load"]


@dataclass(frozen=True)
class TenantLoad:
    """One tenant's load: ``clients`` closed-loop clients, or ``rate`` requests per second."""

    name: str
    clients: int = 0
    rate: float = 0.0


@dataclass(frozen=True)
class FloodLoad:
    tenants: tuple[TenantLoad, ...]  # the flooding tenant first
    open_loop: bool
    prompt_words: int
    max_tokens: int
    warmup_s: float
    duration_s: float
    vocab: int = 32000
    seed: int = 0


@dataclass
class Tenant:
    """One tenant's counted requests over one or more runs of ``duration_s`` each."""

    name: str
    clients: int = 0
    rate: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the failures', not the refusals'
    duration_s: float = 0.0
    window_tokens: int = 0  # tokens served in the window, whenever sent
    window_requests: int = 0  # requests served in the window, whenever sent

    @property
    def tokens(self) -> int:
        """Tokens served: prompt and completion, of the counted requests that succeeded."""
        return sum(o.prompt_tokens + o.completion_tokens for o in self.outcomes if o.ok)

    @property
    def served(self) -> int:
        return sum(o.ok for o in self.outcomes)

    @property
    def shed(self) -> int:
        return sum(o.shed for o in self.outcomes)

    @property
    def failed(self) -> int:
        return sum(not o.ok and not o.shed for o in self.outcomes)

    def shed_reasons(self) -> Counter[str]:
        """The refusals by reason header (``<status> <reason>``; ``no retry-after`` marks one
        that lacked it)."""
        return Counter(f"{o.status} {o.shed_reason or '(no reason)'}"
                       + ("" if o.retry_after else " (no retry-after)")
                       for o in self.outcomes if o.shed)

    def result(self) -> ChatResult:
        return ChatResult(self.outcomes, self.duration_s, self.errors)

    @classmethod
    def pooled(cls, runs: list[Tenant]) -> Tenant:
        """One tenant's runs as one: every request, the runs' durations added up."""
        first = runs[0]
        return cls(first.name, first.clients, first.rate, [o for t in runs for o in t.outcomes],
                   [e for t in runs for e in t.errors], sum(t.duration_s for t in runs),
                   sum(t.window_tokens for t in runs), sum(t.window_requests for t in runs))


def jain(values: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2)."""
    total, squares = sum(values), sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else 0.0


def max_min_shares(capacity: float, demands: list[float]) -> list[float]:
    """Max-min fair allocation of ``capacity`` (water-filling, equal weights): a tenant asking
    less than an equal share of what is left gets what it asks, the rest split the remainder
    alike. A demand of ``math.inf`` is a backlogged tenant."""
    shares = [0.0] * len(demands)
    left = capacity
    for k, i in enumerate(sorted(range(len(demands)), key=lambda i: demands[i])):
        shares[i] = min(demands[i], left / (len(demands) - k))
        left -= shares[i]
    return shares


def fairness(tenants: list[Tenant], open_loop: bool) -> tuple[float, list[float]]:
    """Jain's index over each tenant's service in the window (``window_tokens``) normalised by
    its max-min fair allocation, and those allocations (tokens).

    The capacity shared out is what the stack served in the window, all tenants together
    (its service, whatever it did with the rest). A tenant's demand in an open loop is what
    it sent in the window: its requests times the tokens a served request took (prompt and
    completion; every request here is alike in size); in a closed loop each tenant is
    backlogged (its demand unbounded), so the allocation is an equal split and the index is
    Jain's over the tokens themselves. So a quiet tenant asking less than its equal share is
    entitled to all it asks, and the flooder to the rest: the index is 1 when each tenant got
    exactly its allocation (whatever the flooder asked beyond it), and falls toward 1/n as
    the service departs from it (a quiet tenant shed, or the flooder held below the rest)."""
    served = [float(t.window_tokens) for t in tenants]
    every = [o for t in tenants for o in t.outcomes if o.ok]
    per_request = (sum(o.prompt_tokens + o.completion_tokens for o in every) / len(every)
                   if every else 0.0)
    demands = ([len(t.outcomes) * per_request for t in tenants] if open_loop
               else [math.inf] * len(tenants))
    shares = max_min_shares(sum(served), demands)
    if not all(shares):
        return 0.0, shares
    return jain([s / a for s, a in zip(served, shares, strict=True)]), shares


def _count(tenant: Tenant, outcome: Outcome, errors: list[str], finished: float,
           counted: bool, load: FloodLoad) -> None:
    """One request's end, at ``finished`` seconds from the load's start."""
    if outcome.ok and load.warmup_s <= finished <= load.warmup_s + load.duration_s:
        tenant.window_tokens += outcome.prompt_tokens + outcome.completion_tokens
        tenant.window_requests += 1
    if counted:
        tenant.outcomes.append(outcome)
        if not outcome.shed:
            tenant.errors.extend(errors)


async def _client(session: aiohttp.ClientSession, url: str, tenant: Tenant, seed: int,
                  t0: float, load: FloodLoad) -> None:
    rng = random.Random(seed)
    until = load.warmup_s + load.duration_s
    while time.perf_counter() - t0 < until:
        prompt = [{"role": "user", "content": words(rng, load.prompt_words, load.vocab)}]
        errors: list[str] = []
        outcome, _ = await chat_request(session, url, "tiny", prompt, load.max_tokens, errors)
        finished = time.perf_counter() - t0
        if finished > until:
            break  # finished after the window: not counted, for any stack
        _count(tenant, outcome, errors, finished, finished >= load.warmup_s, load)


def schedule(spec: TenantLoad, load: FloodLoad, seed: int) -> list[tuple[float, str]]:
    """A tenant's Poisson arrivals over the warm-up and the window (seconds from the start)
    and their prompts, from ``seed`` alone: the same for every stack."""
    rng = random.Random(seed)
    out: list[tuple[float, str]] = []
    at = rng.expovariate(spec.rate)
    while at < load.warmup_s + load.duration_s:
        out.append((at, words(rng, load.prompt_words, load.vocab)))
        at += rng.expovariate(spec.rate)
    return out


async def _send(session: aiohttp.ClientSession, url: str, tenant: Tenant, prompt: str,
                counted: bool, t0: float, load: FloodLoad) -> None:
    errors: list[str] = []
    outcome, _ = await chat_request(session, url, "tiny", [{"role": "user", "content": prompt}],
                                    load.max_tokens, errors)
    _count(tenant, outcome, errors, time.perf_counter() - t0, counted, load)


async def _arrivals(session: aiohttp.ClientSession, url: str, tenant: Tenant,
                    arrivals: list[tuple[float, str]], t0: float, load: FloodLoad) -> None:
    """Send each of ``arrivals`` at its time, each its own task; then wait for them all."""
    tasks: list[asyncio.Task[None]] = []
    for at, prompt in arrivals:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(
            _send(session, url, tenant, prompt, at >= load.warmup_s, t0, load)))
    await asyncio.gather(*tasks)


async def _drive(url: str, load: FloodLoad) -> list[Tenant]:
    tenants = [Tenant(spec.name, spec.clients, spec.rate, duration_s=load.duration_s)
               for spec in load.tenants]
    schedules = [schedule(spec, load, load.seed * 1000 + i) if load.open_loop else []
                 for i, spec in enumerate(load.tenants)]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    sessions = [aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
        headers={"authorization": f"Bearer {t.name}-key"}) for t in tenants]
    t0 = time.perf_counter()
    try:
        if load.open_loop:
            await asyncio.gather(*(
                _arrivals(session, url, t, arrivals, t0, load)
                for t, session, arrivals in zip(tenants, sessions, schedules, strict=True)))
        else:
            await asyncio.gather(*(
                _client(session, url, t, load.seed + i * 1000 + c, t0, load)
                for i, (t, session) in enumerate(zip(tenants, sessions, strict=True))
                for c in range(t.clients)))
    finally:
        for session in sessions:
            await session.close()
    return tenants


def run_flood_load(url: str, load: FloodLoad) -> list[Tenant]:
    """Drive ``load`` against ``url`` for its warm-up and window; each tenant's requests (an
    open loop's to their ends)."""
    return asyncio.run(_drive(url, load))
