"""The one block-hash function of kvsidecar (docs/architecture.md, "The canonical KV model").

A request's tokens are cut into full blocks of ``block_size`` tokens (a partial tail block
is never hashed). Block ``i`` gets a chained 64-bit hash that depends on the namespace seed
and on every token of blocks ``0..i``::

    lane_k(b)  = tok[2k] | tok[2k+1] << 32          (u64 lanes, a zero token pads an odd tail)
    local(b)   = Σ_k fmix64(lane_k(b) + LANE_KEY[k])  mod 2^64
    S_{-1}     = namespace seed
    S_i        = S_{i-1} · CHAIN_MUL + local(b_i)      mod 2^64
    h_i        = fmix64(S_i)

``fmix64`` is the splitmix64 finalizer, a bijection on u64, so ``S_{i-1}`` is recoverable
from ``h_{i-1}`` and ``h_i = H(h_{i-1}, tokens of b_i)`` is a true chain: an adapter that
sees a parent hash and a block's tokens computes the child without the whole prefix.

Why not xxh3 per block, like Dynamo? A per-block call from Python costs ~100 ns plus the
slice; this form is a linear recurrence, so a long prompt is hashed with a handful of numpy
passes (a prefix sum against a power table), which is what keeps gateway hashing ahead of
Dynamo's Rust binding (scripts/bench_index.py). Short prompts use the scalar loop below;
both paths are checked equal by the tests and pinned by golden vectors.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

__all__ = ["BlockHasher", "TokenIdError", "fmix64", "fmix64_inverse"]

_MASK = (1 << 64) - 1
CHAIN_MUL = 0x9E3779B97F4A7C15  # odd: multiplication by it is invertible mod 2^64
_CHAIN_MUL_INV = pow(CHAIN_MUL, -1, 1 << 64)
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_M1_INV = pow(_M1, -1, 1 << 64)
_M2_INV = pow(_M2, -1, 1 << 64)
_LANE_KEY_STEP = 0xD6E8FEB86659FD93
# Below this many blocks the scalar loop beats numpy's per-call overhead.
_VECTOR_MIN_BLOCKS = 4


class TokenIdError(ValueError):
    """A token id is not an integer in [0, 2**32)."""


def fmix64(x: int) -> int:
    """splitmix64's finalizer: a bijective avalanche of a u64."""
    x ^= x >> 30
    x = (x * _M1) & _MASK
    x ^= x >> 27
    x = (x * _M2) & _MASK
    return x ^ (x >> 31)


def _unxorshift(x: int, shift: int) -> int:
    y = x
    for _ in range(64 // shift + 1):
        y = x ^ (y >> shift)
    return y


def fmix64_inverse(h: int) -> int:
    """The u64 that ``fmix64`` maps to ``h``."""
    x = _unxorshift(h, 31)
    x = (x * _M2_INV) & _MASK
    x = _unxorshift(x, 27)
    x = (x * _M1_INV) & _MASK
    return _unxorshift(x, 30)


def _np_fmix64(x: np.ndarray) -> np.ndarray:
    x ^= x >> np.uint64(30)
    x *= np.uint64(_M1)
    x ^= x >> np.uint64(27)
    x *= np.uint64(_M2)
    x ^= x >> np.uint64(31)
    return x


class BlockHasher:
    """Chained block hashes for one block size; build one per process and share it.

    It owns the power tables of the vectorized path (grown on demand), so it is not
    thread-safe while a table grows; each thread that hashes should have its own.
    """

    __slots__ = (
        "_inv_powers",
        "_lane_key_array",
        "_lane_keys",
        "_lanes",
        "_powers",
        "block_size",
    )

    def __init__(self, block_size: int = 16) -> None:
        if not 1 <= block_size <= 4096:
            raise ValueError(f"block_size must be in [1, 4096], got {block_size}")
        self.block_size = block_size
        self._lanes = (block_size + 1) // 2
        self._lane_keys = [fmix64((k + 1) * _LANE_KEY_STEP & _MASK) for k in range(self._lanes)]
        self._lane_key_array = np.asarray(self._lane_keys, dtype=np.uint64)
        self._powers = np.ones(1, dtype=np.uint64)  # CHAIN_MUL ** (i + 1)
        self._inv_powers = np.ones(1, dtype=np.uint64)  # CHAIN_MUL ** -(i + 1)
        self._grow(64)

    # --- public API -------------------------------------------------------------------

    def num_full_blocks(self, num_tokens: int) -> int:
        """How many full blocks ``num_tokens`` tokens make."""
        return num_tokens // self.block_size

    def hash_tokens(
        self, token_ids: Sequence[int], seed: int, parent: int | None = None
    ) -> list[int]:
        """Chained hashes of every full block of ``token_ids``.

        ``seed`` is the namespace seed (``Namespace.seed``); with ``parent`` given, the
        blocks continue the chain after that block hash instead of starting at the root.
        """
        n = len(token_ids) // self.block_size
        if n == 0:
            self._check_tokens(token_ids)
            return []
        state = seed if parent is None else fmix64_inverse(parent)
        if n < _VECTOR_MIN_BLOCKS:
            return self._hash_scalar(token_ids, state, n)
        return self._hash_vector(token_ids, state, n)

    def chain(self, parent: int | None, block_tokens: Sequence[int], seed: int) -> int:
        """The hash of one block whose predecessor is ``parent`` (None: the first block)."""
        if len(block_tokens) != self.block_size:
            raise ValueError(f"a block has {self.block_size} tokens, got {len(block_tokens)}")
        return self.hash_tokens(block_tokens, seed, parent)[0]

    def root_seed(self, first_block_hash: int, block_tokens: Sequence[int]) -> int:
        """The namespace seed a chain's first block was hashed under, recovered from its hash
        and tokens (``S_{-1} = (fmix64⁻¹(h_0) − local(b_0)) · CHAIN_MUL⁻¹``): what a consumer
        of events, which name no namespace, files a chain under."""
        if len(block_tokens) != self.block_size:
            raise ValueError(f"a block has {self.block_size} tokens, got {len(block_tokens)}")
        tokens = list(block_tokens)
        for token in tokens:
            if type(token) is not int or not 0 <= token <= 0xFFFFFFFF:
                raise TokenIdError(f"token ids must be integers in [0, 2**32): {token!r}")
        if len(tokens) % 2:
            tokens.append(0)  # a zero token pads an odd tail
        local = sum(fmix64(((tokens[2 * k] | tokens[2 * k + 1] << 32) + key) & _MASK)
                    for k, key in enumerate(self._lane_keys))
        return ((fmix64_inverse(first_block_hash) - local) * _CHAIN_MUL_INV) & _MASK

    # --- the two equivalent paths --------------------------------------------------

    def _packed(self, token_ids: Sequence[int], n: int) -> array[int]:
        count = n * self.block_size
        tokens = token_ids if len(token_ids) == count else token_ids[:count]
        packed = array("I")
        try:
            # fromlist is the fastest list → u32 conversion (and range-checks every id).
            packed.fromlist(tokens if isinstance(tokens, list) else list(tokens))
        except (OverflowError, TypeError) as exc:
            raise TokenIdError(f"token ids must be integers in [0, 2**32): {exc}") from exc
        if self.block_size % 2:
            # Pad each block to an even token count so lanes never straddle blocks.
            padded = array("I", bytes(4 * n * (self.block_size + 1)))
            for b in range(n):
                src = b * self.block_size
                dst = b * (self.block_size + 1)
                padded[dst : dst + self.block_size] = packed[src : src + self.block_size]
            packed = padded
        return packed

    def _check_tokens(self, token_ids: Sequence[int]) -> None:
        try:
            array("I", token_ids)
        except (OverflowError, TypeError) as exc:
            raise TokenIdError(f"token ids must be integers in [0, 2**32): {exc}") from exc

    def _hash_scalar(self, token_ids: Sequence[int], state: int, n: int) -> list[int]:
        packed = self._packed(token_ids, n)
        self._check_tokens(token_ids[n * self.block_size :])
        lanes = np.frombuffer(packed, dtype="<u8").tolist()
        keys = self._lane_keys
        width = self._lanes
        out = []
        for b in range(n):
            local = 0
            for k in range(width):
                x = (lanes[b * width + k] + keys[k]) & _MASK
                x ^= x >> 30
                x = (x * _M1) & _MASK
                x ^= x >> 27
                x = (x * _M2) & _MASK
                local += x ^ (x >> 31)
            state = (state * CHAIN_MUL + local) & _MASK
            out.append(fmix64(state))
        return out

    def _hash_vector(self, token_ids: Sequence[int], state: int, n: int) -> list[int]:
        packed = self._packed(token_ids, n)
        self._check_tokens(token_ids[n * self.block_size :])
        if n > len(self._powers):
            self._grow(n)
        lanes = np.frombuffer(packed, dtype="<u8").reshape(n, self._lanes)
        mixed = _np_fmix64(lanes + self._lane_key_array)
        local = mixed.sum(axis=1, dtype=np.uint64)
        # S_i = P^(i+1) · (S_{-1} + Σ_{j≤i} P^-(j+1) · local_j)   (all mod 2^64)
        local *= self._inv_powers[:n]
        acc = np.cumsum(local, dtype=np.uint64)
        acc += np.uint64(state)
        acc *= self._powers[:n]
        return _np_fmix64(acc).tolist()  # type: ignore[no-any-return]

    def _grow(self, n: int) -> None:
        size = max(n, 2 * len(self._powers))
        powers = np.empty(size, dtype=np.uint64)
        inv = np.empty(size, dtype=np.uint64)
        p, q = CHAIN_MUL, _CHAIN_MUL_INV
        for i in range(size):
            powers[i] = p
            inv[i] = q
            p = (p * CHAIN_MUL) & _MASK
            q = (q * _CHAIN_MUL_INV) & _MASK
        self._powers, self._inv_powers = powers, inv
