"""Canonical hashes of many short chains at once, for batches of small native events.

``BlockHasher.hash_tokens`` is vectorized for long chains but falls back to a scalar
loop below a few blocks, and each call has a fixed cost; both dominate a batch made of many
short events (one page each, as SGLang publishes for requests that add a page).
This module hashes *all* the short chains of a batch with a single vectorized call and then
re-chains each block under its own parent, using only the recurrence ``hashing.py``
documents as its contract::

    S_i = S_{i-1} · CHAIN_MUL + local(b_i)   (mod 2^64),   h_i = fmix64(S_i)

``local(b)`` depends on the block's tokens alone, and ``fmix64`` is a bijection, so the
locals of every block fall out of one chained hash of the concatenated tokens (seed 0):
``local_i = fmix64⁻¹(h_i) − fmix64⁻¹(h_{i−1}) · CHAIN_MUL``. A chain under canonical parent
``p`` (or at the root, under the namespace seed) is then ``S = fmix64⁻¹(p)`` (or the seed),
``S ← S · CHAIN_MUL + local``, ``h = fmix64(S)`` per block. The tests check this equals
``hash_tokens`` on random chains, so a change of the hash function cannot slip past.
"""

from __future__ import annotations

from collections.abc import Sequence

from adapters.canonical.hashing import CHAIN_MUL, BlockHasher, fmix64, fmix64_inverse

__all__ = ["SHORT_CHAIN_BLOCKS", "block_locals", "chain_from_locals"]

_MASK = (1 << 64) - 1
# Chains shorter than this go through the batched path: measured (scripts/bench_adapters.py),
# one vectorized pass plus ~1 µs of re-chaining per block beats a hash_tokens call per chain
# up to about this length; longer chains amortize BlockHasher's own vectorized call.
SHORT_CHAIN_BLOCKS = 16


def block_locals(hasher: BlockHasher, tokens: Sequence[int]) -> list[int]:
    """``local(b)`` of every full block of ``tokens`` (one vectorized hash call)."""
    hashes = hasher.hash_tokens(tokens, 0)
    out = []
    prev = 0
    for h in hashes:
        state = fmix64_inverse(h)
        out.append((state - prev * CHAIN_MUL) & _MASK)
        prev = state
    return out


def chain_from_locals(locals_: Sequence[int], seed: int, parent: int | None) -> list[int]:
    """The canonical hashes of a chain of blocks with these locals under ``parent``."""
    state = seed if parent is None else fmix64_inverse(parent)
    out = []
    for local in locals_:
        state = (state * CHAIN_MUL + local) & _MASK
        out.append(fmix64(state))
    return out
