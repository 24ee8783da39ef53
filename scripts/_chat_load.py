"""A seeded, closed-loop, multi-turn streaming chat load for any OpenAI URL, and what it saw.

The goodput benchmark drives our stack and Dynamo's with it, request for request alike
(the ideas of ``../shared/bench/dynamo/load.py``): ``system_prompts`` prompts of
``system_tokens`` words (one word is one token with the shared WordLevel model), each session
picks one at random and runs ``turns`` turns, each adding ``user_tokens`` fresh words and
asking for exactly ``max_tokens`` (``ignore_eos`` + ``min_tokens``); the reply goes back into
the history, so a later turn shares the whole conversation as its prefix. ``concurrency``
sessions are in flight at once, no think time.

Per request: TTFT and the gaps between content chunks at the client, the mean of which is
the request's ITL; prompt and cached tokens from the reply's usage; the worker that served
it when the reply names one (``x-kvsidecar-worker``). A request meets its targets when its
TTFT and its mean ITL are both within them; goodput is those per second of the run.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

__all__ = ["ChatLoad", "ChatResult", "Outcome", "chat_request", "run_chat", "warm_up", "words"]


@dataclass(frozen=True)
class ChatLoad:
    system_prompts: int
    system_tokens: int
    sessions: int
    turns: int
    concurrency: int
    user_tokens: int = 64
    max_tokens: int = 64
    vocab: int = 32000
    seed: int = 0


@dataclass
class Outcome:
    """One request, as the client saw it."""

    ok: bool
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    worker: str = ""
    status: int = 0  # the reply's HTTP status; 0: none came
    shed_reason: str = ""  # a refusal's x-kvsidecar-shed-reason
    retry_after: str = ""  # a refusal's retry-after

    @property
    def shed(self) -> bool:
        """Refused for load (429 or 503), not failed: what a stack under overload answers."""
        return self.status in (429, 503)

    @property
    def itl_s(self) -> float | None:
        return sum(self.gaps_s) / len(self.gaps_s) if self.gaps_s else None

    def good(self, ttft_target_s: float, itl_target_s: float) -> bool:
        itl = self.itl_s
        return self.ok and self.ttft_s <= ttft_target_s and (itl is None or itl <= itl_target_s)


@dataclass
class ChatResult:
    """Every request of one run, and how long the run took."""

    outcomes: list[Outcome]
    wall_s: float
    errors: list[str]

    @classmethod
    def pooled(cls, runs: list[ChatResult]) -> ChatResult:
        """Several runs of one load as one: every request, the runs' time added up."""
        return cls([o for r in runs for o in r.outcomes], sum(r.wall_s for r in runs),
                   [e for r in runs for e in r.errors])

    def summary(self, ttft_target_s: float, itl_target_s: float) -> dict[str, float]:
        ok = [o for o in self.outcomes if o.ok]
        good = sum(o.good(ttft_target_s, itl_target_s) for o in self.outcomes)
        prompt = sum(o.prompt_tokens for o in ok)
        gaps = [g for o in ok for g in o.gaps_s]
        ttft = [o.ttft_s for o in ok]
        wall = self.wall_s or 1e-9
        by_worker: dict[str, int] = {}
        for o in ok:
            if o.worker:
                by_worker[o.worker] = by_worker.get(o.worker, 0) + 1
        out = {
            "requests": len(ok),
            "failed": len(self.outcomes) - len(ok),
            "wall_s": round(wall, 2),
            "req_per_s": round(len(ok) / wall, 3),
            "goodput_req_per_s": round(good / wall, 3),
            "goodput_share": round(good / len(self.outcomes), 4) if self.outcomes else 0.0,
            "ttft_p50_ms": round(_pct(ttft, 50) * 1e3, 1),
            "ttft_p99_ms": round(_pct(ttft, 99) * 1e3, 1),
            "itl_p50_ms": round(_pct(gaps, 50) * 1e3, 2),
            "itl_p99_ms": round(_pct(gaps, 99) * 1e3, 2),
            "hit_rate": round(sum(o.cached_tokens for o in ok) / prompt, 4) if prompt else 0.0,
        }
        if by_worker:
            out["busiest_worker_share"] = round(max(by_worker.values()) / len(ok), 4)
            out["workers_used"] = len(by_worker)
        return out


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def words(rng: random.Random, n: int, vocab: int) -> str:
    """``n`` random words of the shared model's vocabulary (``w0`` ... ``w<vocab-1>``)."""
    return " ".join(f"w{rng.randrange(vocab)}" for _ in range(n))


async def chat_request(session: aiohttp.ClientSession, url: str, model: str,
                       messages: list[dict[str, str]], max_tokens: int,
                       errors: list[str]) -> tuple[Outcome, str]:
    """One streamed chat of exactly ``max_tokens``, as the client saw it, and the reply's
    text; what went wrong, if anything, is appended to ``errors``."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0,
            "ignore_eos": True, "min_tokens": max_tokens}
    t0 = time.perf_counter()
    out = Outcome(ok=False)
    pieces: list[str] = []
    last = 0.0
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            out.status = resp.status
            if resp.status != 200:
                out.shed_reason = resp.headers.get("x-kvsidecar-shed-reason", "")
                out.retry_after = resp.headers.get("retry-after", "")
                errors.append(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                return out, ""
            out.worker = resp.headers.get("x-kvsidecar-worker", "")
            async for line in resp.content:
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                now = time.perf_counter()
                usage = event.get("usage")
                if usage:
                    out.prompt_tokens = usage.get("prompt_tokens") or 0
                    out.completion_tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = details.get("cached_tokens") or 0
                for choice in event.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if not content:
                        continue
                    pieces.append(content)
                    if not out.ttft_s:
                        out.ttft_s = now - t0
                    else:
                        out.gaps_s.append(now - last)
                    last = now
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        errors.append(repr(exc)[:200])
        return out, ""
    out.ok = bool(pieces)
    if not out.ok:
        errors.append("no content streamed")
    return out, "".join(pieces).strip()


async def _drive(url: str, model: str, load: ChatLoad) -> ChatResult:
    rng = random.Random(load.seed)
    systems = [words(rng, load.system_tokens, load.vocab) for _ in range(load.system_prompts)]
    outcomes: list[Outcome] = []
    errors: list[str] = []
    queue = list(range(load.sessions))
    queue.reverse()

    async def session_loop(session: aiohttp.ClientSession) -> None:
        while queue:
            sid = queue.pop()
            srng = random.Random(load.seed * 1_000_003 + sid)
            messages = [{"role": "system", "content": systems[srng.randrange(len(systems))]}]
            for _ in range(load.turns):
                messages.append({"role": "user",
                                 "content": words(srng, load.user_tokens, load.vocab)})
                outcome, reply = await chat_request(session, url, model, messages,
                                                    load.max_tokens, errors)
                outcomes.append(outcome)
                if not outcome.ok:
                    break
                messages.append({"role": "assistant", "content": reply})

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(session_loop(session) for _ in range(load.concurrency)))
        wall = time.perf_counter() - t0
    return ChatResult(outcomes, wall, errors)


def run_chat(url: str, model: str, load: ChatLoad) -> ChatResult:
    """Drive ``load`` against ``url`` to the end."""
    return asyncio.run(_drive(url, model, load))


def warm_up(url: str, model: str, requests: int, concurrency: int, seed: int = 99) -> None:
    """``requests`` one-turn chats of 64 to 2,048 unrelated tokens, ``concurrency`` at a time
    starting one by one: what a serving stack has seen before a load arrives (a gateway's
    online fits learn from it). Nothing of it is counted."""
    if requests <= 0:
        return
    rng = random.Random(seed)
    prompts = [words(rng, rng.randrange(64, 2048), 32000) for _ in range(requests)]
    errors: list[str] = []

    async def drive() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            async def one(i: int) -> None:
                await asyncio.sleep(0.05 * i)  # a ramp: the batch grows one stream at a time
                for prompt in prompts[i::concurrency]:
                    await chat_request(session, url, model,
                                       [{"role": "user", "content": prompt}], 64, errors)
            await asyncio.gather(*(one(i) for i in range(min(concurrency, requests))))

    asyncio.run(drive())
    if len(errors) == requests:
        raise RuntimeError(f"{url}: every warm-up request failed ({errors[:3]})")
