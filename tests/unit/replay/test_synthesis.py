"""Token synthesis: deterministic, prefix-faithful, distinct, inside the vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.synthesis import TokenSynthesizer, vocab_size_from_model_dir

BLOCK = 512


def test_same_id_same_tokens_across_instances() -> None:
    """Two synthesizers with the same vocab and seed give identical blocks."""
    a, b = TokenSynthesizer(1024), TokenSynthesizer(1024)
    assert a.block(12345) == b.block(12345)
    assert len(a.block(7)) == BLOCK


def test_seed_changes_the_filler_but_not_the_id_digits() -> None:
    """Another seed gives other tokens after the id digits."""
    a, b = TokenSynthesizer(1024, seed=0), TokenSynthesizer(1024, seed=1)
    x, y = a.block(99), b.block(99)
    assert x[: a.digits] == y[: b.digits]
    assert x[a.digits :] != y[b.digits :]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**48 - 1), st.integers(0, 2**48 - 1))
def test_different_ids_differ_within_the_first_digits(i: int, j: int) -> None:
    """Distinct ids differ within a block's first ``digits`` tokens, by construction."""
    synth = TokenSynthesizer(1024)
    blocks = synth.blocks([i, j])
    same = np.array_equal(blocks[0, : synth.digits], blocks[1, : synth.digits])
    assert same == (i == j)


def test_all_distinct_ids_of_a_range_give_distinct_blocks() -> None:
    """Twenty thousand consecutive ids give twenty thousand different blocks."""
    synth = TokenSynthesizer(1024)
    blocks = synth.blocks(range(20_000))
    assert len({row.tobytes() for row in blocks}) == 20_000


def test_tokens_stay_inside_the_vocabulary_above_the_special_ids() -> None:
    """Every token is in [low, vocab_size)."""
    synth = TokenSynthesizer(300, low=16)
    blocks = synth.blocks([0, 1, 2**47, 123456789])
    assert blocks.min() >= 16
    assert blocks.max() < 300


def test_prompts_sharing_k_ids_share_exactly_k_blocks() -> None:
    """Requests with a common first k ids share k×512 tokens and differ right after."""
    synth = TokenSynthesizer(1024)
    a = synth.prompt([0, 5, 9, 11], 1800)
    b = synth.prompt([0, 5, 10, 12], 2048)
    assert len(a) == 1800 and len(b) == 2048
    assert a[: 2 * BLOCK] == b[: 2 * BLOCK]
    first_diff = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert 2 * BLOCK <= first_diff < 2 * BLOCK + synth.digits


def test_prompt_is_the_blocks_cut_to_the_input_length() -> None:
    """A prompt is its blocks concatenated, cut to input_tokens."""
    synth = TokenSynthesizer(1024)
    assert synth.prompt([3, 4], 600) == synth.block(3) + synth.block(4)[:88]


def test_too_few_ids_for_the_length_is_refused() -> None:
    """More prompt tokens than the ids cover raise a specific error."""
    with pytest.raises(ValueError, match="need 3 blocks"):
        TokenSynthesizer(1024).prompt([1, 2], 1100)


def test_negative_ids_and_tiny_vocabularies_are_refused() -> None:
    """Ids out of range and vocabularies without room raise ValueError."""
    with pytest.raises(ValueError, match="outside"):
        TokenSynthesizer(1024).blocks([-1])
    with pytest.raises(ValueError, match="vocab size"):
        TokenSynthesizer(17, low=16)


def test_vocab_size_comes_from_the_model_directory(tmp_path: Path) -> None:
    """config.json's vocab_size is read; a missing or bad one is a clear error."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 32000}))
    assert vocab_size_from_model_dir(tmp_path) == 32000
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_size_from_model_dir(tmp_path)
    with pytest.raises(ValueError, match=r"no config\.json"):
        vocab_size_from_model_dir(tmp_path / "missing")
