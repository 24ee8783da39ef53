"""Compute backends: run a scheduler step and return the next token of each request.

:class:`Executor` is what the engine asks of one: :meth:`run` computes a step's prompt chunks,
then its decode batch (a mixed step has both). ``SimExecutor`` does no math: it sleeps once
for the :class:`TimingModel`'s duration of the whole step and emits deterministic
pseudo-tokens (a function of the sequence so far), so two replicas given the same prompt
still agree. It needs no torch: a
simulated engine loads none (``TorchExecutor``, which runs the real model, lives in
:mod:`refengine.torch_compute`).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from refengine.request import Request
from refengine.scheduler import Step
from refengine.timing import TimingModel

__all__ = ["Executor", "SimExecutor", "StepTokens"]

# A step's tokens: one per prompt chunk (None where the prompt is not complete yet), then
# one per request of the decode batch.
StepTokens = tuple[list[int | None], list[int]]


class Executor(Protocol):
    async def run(self, step: Step) -> StepTokens: ...

    async def load_delay(self, pages: int) -> None: ...


class SimExecutor:
    def __init__(self, timing: TimingModel, first: list[int], rest: list[int]) -> None:
        """``first``, ``rest``: the ids a reply starts with, and goes on with (never EOS,
        so simulated requests run to max_new_tokens); from ``ChatTokenizer.word_token_ids``
        where the tokenizer has them: replies that tokenize back to themselves."""
        if not first or not rest:
            raise ValueError("a simulated engine needs token ids to emit")
        self.timing = timing
        self.first = first
        self.rest = rest
        self.busy_s = 0.0

    def _token(self, req: Request, first: bool = False) -> int:
        """A deterministic function of the sequence so far: the same prompt, the same reply."""
        tail = req.all_tokens()[-4:]
        vocab = self.first if first else self.rest
        return vocab[(sum((i + 1) * t for i, t in enumerate(tail)) * 31 + req.num_tokens)
                     % len(vocab)]

    async def _sleep(self, seconds: float) -> None:
        self.busy_s += seconds
        await asyncio.sleep(seconds)

    async def run(self, step: Step) -> StepTokens:
        await self._sleep(self.timing.step(
            [(c.end - c.start, c.end) for c in step.prefill],
            [r.num_tokens for r in step.decode],
            yields=step.yields_tokens, kv_used=step.kv_used))
        first = [self._token(c.req, True) if c.completes_prompt else None for c in step.prefill]
        return first, [self._token(r) for r in step.decode]

    async def load_delay(self, pages: int) -> None:
        await self._sleep(self.timing.load(pages))
