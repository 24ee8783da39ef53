"""The canonical block hash: golden vectors, the spec, and the properties routing relies on."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore import BlockHasher, Namespace, TokenIdError
from kvcore.hashing import fmix64, fmix64_inverse

MASK = (1 << 64) - 1
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"

# Fixed inputs → fixed outputs. Changing any of these changes every hash in every cache: a
# wire-format break that needs a new namespace domain, not an edited vector.
GOLDEN_SEEDS = {
    (LLAMA, None, None): 0xCD72EA52DFFF68CC,
    (LLAMA, "sql-lora", None): 0xD8ECE58C275DF193,
    (LLAMA, None, "tenant-a"): 0x19C876F2F9A5C3FE,
}
GOLDEN_CHAINS = [
    # (block_size, tokens, seed, hashes)
    (
        16,
        list(range(64)),
        0,
        [0x6EEE052C4FEF9387, 0x5EC4C94DBE547A05, 0x8255A2C37D0AE36B, 0x6B72DD7B8317AD2A],
    ),
    (16, [2**32 - 1] * 32 + [7] * 5, 12345, [0x8EA45A7234ADB9D5, 0x283EF3C451648A35]),
    (3, list(range(10)), 1, [0xCF75C4C56E9B56BE, 0x2D84A54894738754, 0xADD32CC83DDC9ED9]),
]


def reference_hashes(tokens: list[int], seed: int, block_size: int) -> list[int]:
    """The module docstring's definition, written out independently and slowly."""
    lanes_per_block = (block_size + 1) // 2
    keys = [fmix64((k + 1) * 0xD6E8FEB86659FD93 & MASK) for k in range(lanes_per_block)]
    state, out = seed, []
    for b in range(len(tokens) // block_size):
        block = tokens[b * block_size : (b + 1) * block_size] + [0] * (block_size % 2)
        local = 0
        for k in range(lanes_per_block):
            lane = block[2 * k] | (block[2 * k + 1] << 32)
            local = (local + fmix64((lane + keys[k]) & MASK)) & MASK
        state = (state * 0x9E3779B97F4A7C15 + local) & MASK
        out.append(fmix64(state))
    return out


class TestGoldenVectors:
    @pytest.mark.parametrize(("key", "seed"), list(GOLDEN_SEEDS.items()))
    def test_namespace_seeds(self, key: tuple[str, str | None, str | None], seed: int) -> None:
        """Namespace seeds are fixed for fixed (model, LoRA, salt)."""
        assert Namespace(*key).seed == seed

    @pytest.mark.parametrize(("block_size", "tokens", "seed", "expected"), GOLDEN_CHAINS)
    def test_chains(
        self, block_size: int, tokens: list[int], seed: int, expected: list[int]
    ) -> None:
        """Block hashes are fixed for fixed tokens, seed and block size."""
        assert BlockHasher(block_size).hash_tokens(tokens, seed) == expected
        assert reference_hashes(tokens, seed, block_size) == expected


class TestDefinition:
    @settings(max_examples=200, deadline=None)
    @given(
        st.lists(st.integers(0, 2**32 - 1), max_size=700),
        st.integers(0, MASK),
        st.sampled_from([1, 2, 3, 16, 17, 64]),
    )
    def test_matches_reference(self, tokens: list[int], seed: int, block_size: int) -> None:
        """Both the scalar and the vectorized path compute the documented definition."""
        assert BlockHasher(block_size).hash_tokens(tokens, seed) == reference_hashes(
            tokens, seed, block_size
        )

    @settings(max_examples=100, deadline=None)
    @given(st.lists(st.integers(0, 2**32 - 1), min_size=32, max_size=600), st.data())
    def test_chain_continues_from_any_parent(self, tokens: list[int], data: st.DataObject) -> None:
        """Hashing a suffix after block i's hash gives the same hashes as the whole prompt."""
        hasher = BlockHasher(16)
        full = hasher.hash_tokens(tokens, 99)
        i = data.draw(st.integers(0, len(full) - 1))
        assert hasher.hash_tokens(tokens[(i + 1) * 16 :], 99, parent=full[i]) == full[i + 1 :]
        if i + 1 < len(full):
            block = tokens[(i + 1) * 16 : (i + 2) * 16]
            assert hasher.chain(full[i], block, 99) == full[i + 1]

    @given(st.integers(0, MASK))
    def test_fmix_is_a_bijection(self, x: int) -> None:
        """fmix64_inverse undoes fmix64, so a parent hash recovers the chain state."""
        assert fmix64_inverse(fmix64(x)) == x

    def test_partial_tail_is_not_hashed(self) -> None:
        """Only full blocks get a hash; the tail changes nothing."""
        hasher = BlockHasher(16)
        assert hasher.hash_tokens(list(range(47)), 1) == hasher.hash_tokens(list(range(32)), 1)
        assert hasher.hash_tokens(list(range(15)), 1) == []

    def test_prefix_dependence(self) -> None:
        """A block's hash depends on every earlier block, not only its own tokens."""
        hasher = BlockHasher(16)
        a = hasher.hash_tokens([1] * 16 + [2] * 16, 0)
        b = hasher.hash_tokens([3] * 16 + [2] * 16, 0)
        assert a[1] != b[1]
        swapped = hasher.hash_tokens([2] * 16 + [1] * 16, 0)
        assert swapped[1] != a[1]


class TestNamespaces:
    def test_identical_tokens_differ_across_namespaces(self) -> None:
        """Another model, adapter or tenant never shares a block hash for the same tokens."""
        hasher = BlockHasher(16)
        tokens = list(range(160))
        spaces = [
            Namespace(LLAMA),
            Namespace(LLAMA, "sql-lora"),
            Namespace(LLAMA, None, "tenant-a"),
            Namespace(LLAMA, "sql-lora", "tenant-a"),
            Namespace("Qwen/Qwen3-8B"),
        ]
        hashes = [set(hasher.hash_tokens(tokens, ns.seed)) for ns in spaces]
        for i, a in enumerate(hashes):
            for b in hashes[i + 1 :]:
                assert not a & b

    def test_empty_adapter_or_salt_means_none(self) -> None:
        """An empty LoRA name or salt is the same namespace as none."""
        assert Namespace(LLAMA, "", "").seed == Namespace(LLAMA).seed

    def test_fields_cannot_be_confused(self) -> None:
        """A LoRA name and a salt with the same text give different namespaces."""
        assert Namespace(LLAMA, "x", None).seed != Namespace(LLAMA, None, "x").seed

    def test_model_id_required(self) -> None:
        """A namespace without a model id is rejected."""
        with pytest.raises(ValueError, match="model id"):
            Namespace("")


class TestBadInput:
    @pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7", None])
    @pytest.mark.parametrize("length", [1, 16, 200])
    def test_bad_token_ids(self, bad: object, length: int) -> None:
        """A token id outside [0, 2**32) or not an int raises TokenIdError, whatever the path."""
        tokens: list[object] = [1] * length
        tokens[length // 2] = bad
        with pytest.raises(TokenIdError):
            BlockHasher(16).hash_tokens(tokens, 0)  # type: ignore[arg-type]

    def test_bad_block_size(self) -> None:
        """A block size outside [1, 4096] is rejected."""
        with pytest.raises(ValueError, match="block_size"):
            BlockHasher(0)

    def test_chain_needs_a_whole_block(self) -> None:
        """chain() refuses a block of the wrong length."""
        with pytest.raises(ValueError, match="16 tokens"):
            BlockHasher(16).chain(None, [1, 2, 3], 0)
