"""Block hashes of recently seen prompt prefixes, so a shared prefix is hashed once.

The tokenizer reports *prefix keys*: one per piece boundary of a rendered prompt, equal for
equal rendered prefixes (``PromptTokenizer.encode_chat(..., bounds)``). Block hashes are
chained, so the hashes of the full blocks inside a prefix depend on that prefix only: they
are cached per (namespace seed, prefix key), and a new request hashes just the blocks after
its longest cached prefix, continuing the chain from the last cached block.

Entries share the hash list of the request that stored them. The cache is bounded by the
number of blocks its entries name; when that passes the limit it starts over (cheaper than
LRU bookkeeping on every hit, and a hot prefix is back after one request).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore import BlockHasher

__all__ = ["PrefixHashCache"]


class PrefixHashCache:
    """(seed, prefix key) → the chained block hashes of that prefix's full blocks."""

    def __init__(self, hasher: BlockHasher, max_blocks: int = 1_000_000) -> None:
        self.hasher = hasher
        self.max_blocks = max_blocks
        self._entries: dict[tuple[int, int], tuple[list[int], int]] = {}
        self._blocks = 0
        self.hit_blocks = 0  # blocks taken from the cache (a counter, never reset)

    def hash_tokens(
        self, tokens: Sequence[int], bounds: Sequence[tuple[int, int]], seed: int
    ) -> list[int]:
        """``hasher.hash_tokens(tokens, seed)``, reusing the longest cached prefix."""
        block_size = self.hasher.block_size
        entries = self._entries
        hashes: list[int] | None = None
        for key, _ in reversed(bounds):
            entry = entries.get((seed, key))
            if entry is not None:
                cached, count = entry
                prefix = cached[:count]
                self.hit_blocks += count
                start = count * block_size
                hashes = prefix + self.hasher.hash_tokens(tokens[start:], seed, prefix[-1])
                break
        if hashes is None:
            hashes = self.hasher.hash_tokens(tokens, seed)
        for key, num_tokens in bounds:
            count = num_tokens // block_size
            if count and (seed, key) not in entries:
                entries[(seed, key)] = (hashes, count)
                self._blocks += count
        if self._blocks > self.max_blocks:
            self.clear()
        return hashes

    def clear(self) -> None:
        self._entries.clear()
        self._blocks = 0
