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
``local_i = fmix64⁻¹(h_i) − fmix64⁻¹(h_{i−1}) · CHAIN_MUL`` (inverted in numpy too, from
the splitmix64 finalizer ``hashing.py`` names as ``fmix64``). A chain under canonical parent
``p`` (or at the root, under the namespace seed) is then ``S = fmix64⁻¹(p)`` (or the seed),
``S ← S · CHAIN_MUL + local``, ``h = fmix64(S)`` per block. The tests check this equals
``hash_tokens`` on random chains, so a change of the hash function cannot slip past.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvcore.hashing import CHAIN_MUL, BlockHasher, fmix64, fmix64_inverse

__all__ = ["SHORT_CHAIN_BLOCKS", "block_locals", "chain_from_locals", "chain_states"]

_MASK = (1 << 64) - 1
# Chains shorter than this go through the batched path: measured (scripts/bench_adapters.py),
# one vectorized pass plus ~1 µs of re-chaining per block beats a hash_tokens call per chain
# up to about this length; longer chains amortize BlockHasher's own vectorized call.
SHORT_CHAIN_BLOCKS = 16


# fmix64's constants, inverted mod 2^64 (fmix64 is x ^= x >> 30; x *= M1; x ^= x >> 27;
# x *= M2; x ^= x >> 31). The tests check _np_fmix64_inverse against fmix64_inverse.
_M1_INV = np.uint64(pow(0xBF58476D1CE4E5B9, -1, 1 << 64))
_M2_INV = np.uint64(pow(0x94D049BB133111EB, -1, 1 << 64))
_NP_CHAIN_MUL = np.uint64(CHAIN_MUL)


def _np_unxorshift(x: np.ndarray, shift: int) -> np.ndarray:
    """Invert ``x ^= x >> shift`` element-wise: each pass fixes ``shift`` more top bits."""
    s = np.uint64(shift)
    y = x
    for _ in range(-(-64 // shift) - 1):
        y = x ^ (y >> s)
    return y


def _np_fmix64_inverse(h: np.ndarray) -> np.ndarray:
    """``fmix64_inverse`` of every element of a u64 array (wrapping arithmetic)."""
    x = _np_unxorshift(h, 31)
    x = x * _M2_INV
    x = _np_unxorshift(x, 27)
    x = x * _M1_INV
    return _np_unxorshift(x, 30)


def block_locals(hasher: BlockHasher, tokens: Sequence[int]) -> list[int]:
    """``local(b)`` of every full block of ``tokens`` (one vectorized hash call, and the
    inversion of its chain vectorized too)."""
    hashes = hasher.hash_tokens(tokens, 0)
    if not hashes:
        return []
    states = _np_fmix64_inverse(np.array(hashes, dtype=np.uint64))
    locals_ = states.copy()
    locals_[1:] -= states[:-1] * _NP_CHAIN_MUL
    return locals_.tolist()  # type: ignore[no-any-return]


def chain_states(locals_: Sequence[int], state: int) -> tuple[list[int], int]:
    """The hashes of a chain of blocks with these locals after chain state ``state`` (the
    namespace seed at the root, ``fmix64⁻¹(parent)`` under a parent), and the chain state
    after its last block (``fmix64⁻¹`` of the last hash: what a child continues from)."""
    out = []
    for local in locals_:
        state = (state * CHAIN_MUL + local) & _MASK
        out.append(fmix64(state))
    return out, state


def chain_from_locals(locals_: Sequence[int], seed: int, parent: int | None) -> list[int]:
    """The canonical hashes of a chain of blocks with these locals under ``parent``."""
    return chain_states(locals_, seed if parent is None else fmix64_inverse(parent))[0]
