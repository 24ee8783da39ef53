"""Compute backends: run a scheduler step and return the next token of each request.

``TorchExecutor`` runs the real model on the paged pool (in a worker thread, so the event loop
keeps serving HTTP); ``SimExecutor`` does no math: it sleeps for the :class:`TimingModel`'s
duration and emits deterministic pseudo-tokens (a function of the sequence so far), so two
replicas given the same prompt still agree.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Protocol

import torch

from refengine.kv_pool import TorchKVStore
from refengine.model import LlamaModel
from refengine.request import Request, SamplingParams
from refengine.scheduler import PrefillChunk
from refengine.timing import TimingModel

__all__ = ["Executor", "SimExecutor", "TorchExecutor", "sample"]


class Executor(Protocol):
    async def prefill(self, chunks: tuple[PrefillChunk, ...]) -> list[int | None]: ...

    async def decode(self, reqs: tuple[Request, ...]) -> list[int]: ...

    async def load_delay(self, pages: int) -> None: ...


def _generator(req: Request) -> torch.Generator:
    seed = req.params.seed
    if seed is None:
        seed = int.from_bytes(hashlib.blake2b(req.rid.encode(), digest_size=8).digest(), "big")
    return torch.Generator().manual_seed(seed + len(req.output_ids))


def penalize(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """SGLang's penalties: repetition over prompt and output (a positive logit divided, a
    negative one multiplied), frequency and presence over the output so far (subtracted per
    occurrence and once)."""
    if params.repetition_penalty != 1.0:
        logits = logits.clone()
        seen = torch.tensor(sorted({t for t in (*prompt, *output) if t < logits.numel()}))
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(
                vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty
            )
    if output and (params.frequency_penalty or params.presence_penalty):
        logits = logits.clone()
        ids, counts = torch.unique(torch.tensor(output), return_counts=True)
        keep = ids < logits.numel()
        ids, counts = ids[keep], counts[keep]
        logits[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Greedy when temperature is 0 (or top_k 1); else temperature, top-k, top-p sampling."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen))


def _slots(req: Request, start: int, end: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(start, end)
    pages = torch.tensor(req.pages, dtype=torch.long)
    return pages[pos // page_size] * page_size + pos % page_size


class TorchExecutor:
    def __init__(self, model: LlamaModel, kv: TorchKVStore, vocab_limit: int) -> None:
        self.model = model
        self.kv = kv
        self.page_size = kv.page_size
        self.vocab_limit = vocab_limit  # tokenizer vocab; the model may have padding rows

    def _pick(self, logits: torch.Tensor, req: Request) -> int:
        logits = penalize(logits[: self.vocab_limit], req.params, req.prompt, req.output_ids)
        return sample(logits, req.params, _generator(req))

    def _prefill(self, chunks: tuple[PrefillChunk, ...]) -> list[int | None]:
        out: list[int | None] = []
        for c in chunks:
            req = c.req
            tokens = torch.tensor(req.prompt[c.start : c.end], dtype=torch.long)
            logits = self.model.prefill(
                tokens,
                c.start,
                _slots(req, c.start, c.end, self.page_size),
                _slots(req, 0, c.end, self.page_size),
                k_cache=self.kv.k_cache,
                v_cache=self.kv.v_cache,
            )
            out.append(self._pick(logits, req) if c.completes_prompt else None)
        return out

    def _decode(self, reqs: tuple[Request, ...]) -> list[int]:
        lens = [r.num_tokens for r in reqs]
        width = max(lens)
        ctx = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ctx[i, : lens[i]] = _slots(r, 0, lens[i], self.page_size)
        positions = torch.tensor([n - 1 for n in lens], dtype=torch.long)
        write = ctx[torch.arange(len(reqs)), positions]
        tokens = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.long)
        logits = self.model.decode(
            tokens,
            positions,
            write,
            ctx,
            torch.tensor(lens),
            k_cache=self.kv.k_cache,
            v_cache=self.kv.v_cache,
        )
        return [self._pick(logits[i], r) for i, r in enumerate(reqs)]

    async def prefill(self, chunks: tuple[PrefillChunk, ...]) -> list[int | None]:
        return await asyncio.to_thread(self._prefill, chunks)

    async def decode(self, reqs: tuple[Request, ...]) -> list[int]:
        return await asyncio.to_thread(self._decode, reqs)

    async def load_delay(self, pages: int) -> None:
        return None  # real copies already took their time


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

    async def prefill(self, chunks: tuple[PrefillChunk, ...]) -> list[int | None]:
        await self._sleep(self.timing.prefill([(c.end - c.start, c.end) for c in chunks]))
        return [self._token(c.req, True) if c.completes_prompt else None for c in chunks]

    async def decode(self, reqs: tuple[Request, ...]) -> list[int]:
        await self._sleep(self.timing.decode([r.num_tokens for r in reqs]))
        return [self._token(r) for r in reqs]

    async def load_delay(self, pages: int) -> None:
        await self._sleep(self.timing.load(pages))
