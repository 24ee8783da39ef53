"""Compute backends: run a scheduler step and return the next token of each request.

:class:`Executor` is what the engine asks of one: :meth:`run` computes a step's prompt chunks,
then its decode batch (a mixed step has both). ``SimExecutor`` does no math: a step lasts
the :class:`TimingModel`'s duration of the whole step on a simulated device, and it emits
deterministic pseudo-tokens (a function of the sequence so far), so two replicas given the
same prompt still agree.

The simulated device works as a GPU under an overlapping scheduler does (SGLang's overlap
scheduler, vLLM's async scheduling, and Dynamo's mocker, whose host work takes
microseconds): the host's work between two steps (the engine's bookkeeping, streaming the
tokens out, and other replicas' turns on the shared event loop) runs while the device
computes the step before, so a busy replica steps once per modelled duration, not once per
duration plus our Python's time. Host work longer than the step before it still delays the
next step, and a replica that ran out of work (``idle``) starts its next step when it is
issued (or when the step before it ends). Without this, the simulator's own CPU time would
stretch every step (1.8 ms a 136 ms step on the goodput bench's capacity load) where the
mocker's does not. It needs no torch: a simulated engine loads none (``TorchExecutor``,
which runs the real model, lives in :mod:`refengine.torch_compute`).

A step's tokens leave when its timing model says (``TimingModel.step_parts``: the linear
model's at the step's end, the mocker's after the step's prefill part, while its decode
part still runs, as Dynamo's mocker emits them), to the microsecond
(``refengine.device_clock``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from refengine.device_clock import DeviceClock
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

    def idle(self) -> None:
        """The engine has no work left: what follows is not the host's work between steps."""


class SimExecutor:
    def __init__(self, timing: TimingModel, first: list[int], rest: list[int], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``first``, ``rest``: the ids a reply starts with, and goes on with (never EOS,
        so simulated requests run to max_new_tokens); from ``ChatTokenizer.word_token_ids``
        where the tokenizer has them: replies that tokenize back to themselves. ``clock``:
        the time the device's steps are laid out on (a test's virtual clock)."""
        if not first or not rest:
            raise ValueError("a simulated engine needs token ids to emit")
        self.timing = timing
        self.first = first
        self.rest = rest
        self.busy_s = 0.0
        self._clock = clock
        self._device_free_at: float | None = None  # the last step's end; None: none yet
        self._idle = True  # out of work since that step: host time is not hidden behind it
        self._last_took = 0.0  # the last step's duration: the host work it can hide
        # on the real clock, steps end to the microsecond (refengine.device_clock)
        self._device_clock = DeviceClock() if clock is time.monotonic else None

    def _token(self, req: Request, first: bool = False) -> int:
        """A deterministic function of the sequence so far: the same prompt, the same reply."""
        tail = req.all_tokens()[-4:]
        vocab = self.first if first else self.rest
        return vocab[(sum((i + 1) * t for i, t in enumerate(tail)) * 31 + req.num_tokens)
                     % len(vocab)]

    async def _sleep(self, seconds: float, after: float = 0.0) -> None:
        """Run ``seconds`` of device work, then ``after`` more: it starts when the device is
        free and the host has issued it, the host's time since the last step hidden up to
        that step's duration (see the module's docstring); return when ``seconds`` have
        passed (the device stays busy for ``after``: the next step starts behind it)."""
        end = self.lay_out(seconds + after) - after
        if self._device_clock is not None:
            await self._device_clock.sleep_until(end)
        else:
            await asyncio.sleep(max(0.0, end - self._clock()))

    def lay_out(self, seconds: float) -> float:
        """Place ``seconds`` of device work issued now on the device's timeline; its end."""
        now = self._clock()
        start = now
        if self._device_free_at is not None:
            if self._idle:  # nothing to hide behind, but a step may still be running
                start = max(self._device_free_at, now)
            else:
                start = max(self._device_free_at, now - self._last_took)
        self._idle = False
        end = start + seconds
        self._device_free_at, self._last_took = end, seconds
        self.busy_s += seconds
        return end

    def idle(self) -> None:
        self._idle = True

    @property
    def device_idle(self) -> bool:
        """No step since the engine last ran out of work."""
        return self._idle

    async def run(self, step: Step) -> StepTokens:
        await self._sleep(*self.timing.step_parts(
            [(c.end - c.start, c.end) for c in step.prefill],
            [r.num_tokens for r in step.decode],
            yields=step.yields_tokens, kv_attended=step.kv_attended))
        first = [self._token(c.req, True) if c.completes_prompt else None for c in step.prefill]
        return first, [self._token(r) for r in step.decode]

    async def load_delay(self, pages: int) -> None:
        await self._sleep(self.timing.load(pages))
