"""Deterministic prompt tokens for trace records that carry only prefix ids.

A Mooncake record names its prompt as a list of ids, one per 512-token block, each standing
for the whole prefix up to that block. To send it to a real engine we need token ids with the
same sharing structure: identical ids → identical tokens, different ids → different tokens.

Guaranteed by construction, not by luck: the first ``digits`` tokens of a block spell the id
in base ``vocab_size − low`` (least significant digit first), so two different ids differ
within a block's first ``digits`` tokens; the remaining tokens come from a vectorized 64-bit
integer hash (splitmix64) of (id, position), which only has to look varied. Token ids stay in
``[low, vocab_size)``, clear of the low ids tokenizers reserve for BOS/EOS/padding.

A request's prompt is its blocks concatenated, cut to ``input_tokens``; because ids are prefix
hashes, two requests that share their first k ids share exactly their first k×512 tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from replay.traces import TRACE_BLOCK_TOKENS

__all__ = ["DEFAULT_LOW_TOKEN", "ID_BITS", "TokenSynthesizer", "vocab_size_from_model_dir"]

DEFAULT_LOW_TOKEN = 16  # ids below this are left alone (BOS, EOS, PAD, ... in most vocabs)
ID_BITS = 48  # ids up to 2**48 − 1 are encoded exactly

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finalizer, elementwise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def vocab_size_from_model_dir(path: str | Path) -> int:
    """``vocab_size`` from a model directory's ``config.json``."""
    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError as exc:
        raise ValueError(f"model directory {path} has no config.json") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from exc
    vocab = raw.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"{file} has no positive integer vocab_size (got {vocab!r})")
    return vocab


class TokenSynthesizer:
    """Token ids for trace blocks and prompts, a pure function of (id, position, seed)."""

    __slots__ = ("_seed", "base", "block_tokens", "digits", "low", "vocab_size")

    def __init__(
        self,
        vocab_size: int,
        *,
        block_tokens: int = TRACE_BLOCK_TOKENS,
        low: int = DEFAULT_LOW_TOKEN,
        seed: int = 0,
    ) -> None:
        if low < 0:
            raise ValueError(f"low token id must be >= 0, got {low}")
        if vocab_size - low < 2:
            raise ValueError(
                f"vocab size {vocab_size} leaves fewer than 2 token ids above {low}: "
                "cannot encode block ids"
            )
        self.vocab_size = vocab_size
        self.low = low
        self.base = vocab_size - low
        self.digits = math.ceil(ID_BITS / math.log2(self.base))
        if self.digits > block_tokens:
            raise ValueError(
                f"{block_tokens}-token blocks cannot hold the {self.digits} tokens that spell "
                f"an id in base {self.base}"
            )
        self.block_tokens = block_tokens
        self._seed = np.uint64(seed & 0xFFFFFFFFFFFFFFFF)

    def blocks(self, hash_ids: Sequence[int]) -> npt.NDArray[np.int64]:
        """A ``(len(hash_ids), block_tokens)`` int64 array: each row one id's tokens."""
        ids = np.asarray(hash_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= 1 << ID_BITS):
            bad = int(ids[(ids < 0) | (ids >= 1 << ID_BITS)][0])
            raise ValueError(f"hash id {bad} is outside [0, 2**{ID_BITS})")
        uid = ids.astype(np.uint64)[:, None]
        pos = np.arange(self.block_tokens, dtype=np.uint64)[None, :]
        with np.errstate(over="ignore"):
            h = _mix((uid * _GOLDEN) ^ _mix(pos + self._seed * _GOLDEN + _GOLDEN))
        out = (h % np.uint64(self.base)).astype(np.int64)
        rest = ids.copy()
        for d in range(self.digits):  # the id itself, least significant digit first
            out[:, d] = rest % self.base
            rest //= self.base
        return out + self.low

    def block(self, hash_id: int) -> list[int]:
        """One id's ``block_tokens`` tokens."""
        tokens: list[int] = self.blocks([hash_id])[0].tolist()
        return tokens

    def prompt(self, hash_ids: Sequence[int], input_tokens: int) -> list[int]:
        """The blocks of ``hash_ids`` concatenated, cut to ``input_tokens``."""
        if input_tokens < 0:
            raise ValueError(f"input_tokens must be >= 0, got {input_tokens}")
        if input_tokens > len(hash_ids) * self.block_tokens:
            raise ValueError(
                f"{input_tokens} prompt tokens need {math.ceil(input_tokens / self.block_tokens)}"
                f" blocks of {self.block_tokens}, the record has {len(hash_ids)} ids"
            )
        needed = math.ceil(input_tokens / self.block_tokens)
        tokens: list[int] = self.blocks(hash_ids[:needed]).reshape(-1)[:input_tokens].tolist()
        return tokens
