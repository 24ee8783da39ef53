"""The one home of KV bytes-per-block arithmetic."""

from __future__ import annotations

import pytest

from kvcore.layout import BlockLayout, LayoutKind


def test_bytes_per_block_formula() -> None:
    """bytes = layers × 2 × kv_heads × head_dim × block_size × dtype bytes."""
    layout = BlockLayout(
        num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16"
    )
    assert layout.bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert layout.bytes_per_block == layout.bytes_per_token * 16
    assert layout.blocks_in(10 * layout.bytes_per_block + 5) == 10


def test_shapes_name_the_layout() -> None:
    """Each layout kind has its own element order with the same element count."""
    lf = BlockLayout(4, 2, 8, 16, "float16", LayoutKind.LAYER_FIRST)
    pf = BlockLayout(4, 2, 8, 16, "float16", LayoutKind.PAGE_FIRST)
    assert lf.shape() == (4, 2, 16, 2, 8) and pf.shape() == (16, 4, 2, 2, 8)


def test_from_config_without_kv_heads() -> None:
    """Without num_key_value_heads every attention head has its own KV (MHA)."""
    layout = BlockLayout.from_model_config(
        {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}
    )
    assert (layout.num_kv_heads, layout.head_dim, layout.dtype) == (4, 64, "bfloat16")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"num_layers": 0}, "num_layers"), ({"dtype": "float12"}, "unknown dtype")],
)
def test_bad_layouts(kwargs: dict[str, object], message: str) -> None:
    """Impossible sizes and unknown dtypes are rejected with the field named."""
    base: dict[str, object] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8}
    with pytest.raises(ValueError, match=message):
        BlockLayout(**{**base, **kwargs})  # type: ignore[arg-type]
