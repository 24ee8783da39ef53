"""Torch compute: the paged KV tensors and the executor that runs the real model on them.

``TorchKVStore`` is the device pool's bytes for the torch model; ``TorchExecutor`` runs
prefill and decode steps on it (in a worker thread, so the event loop keeps serving HTTP),
with SGLang's penalties and sampling (``penalize``, ``sample``). Only a ``--compute torch``
engine imports this module (a simulated one runs :class:`refengine.executor.SimExecutor` and
never loads torch).
"""

from __future__ import annotations

import asyncio
import hashlib

import torch

from refengine.executor import StepTokens
from refengine.kv_pool import torch_dtype
from refengine.model import LlamaModel
from refengine.presets import ModelConfig
from refengine.request import Request, SamplingParams
from refengine.scheduler import PrefillChunk, Step

__all__ = ["TorchExecutor", "TorchKVStore", "penalize", "sample"]


class TorchKVStore:
    """One pre-faulted tensor ``[pages, 2 (K,V), layers, page_size, kv_heads, head_dim]``: a
    page's KV is contiguous, so exporting or importing pages is a single gather or scatter.
    The model sees per-layer views ``[pages, page_size, kv_heads, head_dim]`` (``k_cache[l]``,
    ``v_cache[l]``) and addresses token slot ``s`` as ``[s // page_size, s % page_size]``.
    """

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.dtype = torch_dtype(cfg.torch_dtype)
        self.layers = cfg.num_hidden_layers
        self.kv_heads, self.head_dim = cfg.num_key_value_heads, cfg.head_dim
        shape = (num_pages, 2, self.layers, page_size, self.kv_heads, self.head_dim)
        # zeros() touches every page now, so the first requests do not pay for page faults.
        self.kv = torch.zeros(shape, dtype=self.dtype)
        self.k_cache = [self.kv[:, 0, layer] for layer in range(self.layers)]
        self.v_cache = [self.kv[:, 1, layer] for layer in range(self.layers)]
        self.page_numel = 2 * self.layers * page_size * self.kv_heads * self.head_dim

    def _flat(self) -> torch.Tensor:
        return self.kv.view(self.kv.shape[0], self.page_numel)

    def read_pages(self, pages: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        idx = torch.tensor(pages, dtype=torch.long)
        if out is None:
            return self._flat().index_select(0, idx)
        return torch.index_select(self._flat(), 0, idx, out=out)  # straight into ``out``

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        idx = torch.tensor(pages, dtype=torch.long)
        self._flat().index_copy_(0, idx, data.reshape(len(pages), self.page_numel).to(self.dtype))


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

    def _run(self, step: Step) -> StepTokens:
        first = self._prefill(step.prefill) if step.prefill else []
        return first, self._decode(step.decode) if step.decode else []

    async def run(self, step: Step) -> StepTokens:
        return await asyncio.to_thread(self._run, step)

    async def load_delay(self, pages: int) -> None:
        return None  # real copies already took their time

    def idle(self) -> None:
        return None  # real steps take the time they take
