"""KV block memory layout and sizing: the one home of the bytes-per-block formula.

A block's KV bytes are ``layers × 2 (K and V) × kv_heads × head_dim × block_size × dtype
bytes``. The *layout* says how those bytes are ordered in a flat block buffer:

* ``layer_first``: ``[layer][k|v][block_size][kv_heads][head_dim]`` — one contiguous run per
  layer, what an engine's per-layer KV tensors give when a block is gathered layer by layer;
* ``page_first``: ``[block_size][layer][k|v][kv_heads][head_dim]`` — token-major, what
  SGLang's HiCache calls ``page_first``;
* ``raw``: the engine's own page order, opaque to us — what a storage hook that cannot reorder
  a page writes (the reference engine's and TensorRT-LLM's; SGLang's MLA pools). Blocks are
  then exchangeable only between engines with the same KV cache layout.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DTYPE_BYTES", "BlockLayout", "LayoutKind"]

DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class LayoutKind(enum.Enum):
    """How a block's bytes are ordered (see the module docstring)."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    RAW = "raw"


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Shape of one KV block in memory."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = "bfloat16"
    kind: LayoutKind = LayoutKind.LAYER_FIRST

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_BYTES)}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def shape(self) -> tuple[int, ...]:
        """The block's array shape in this layout (element counts, not bytes; ``raw``:
        flat, its order the engine's)."""
        if self.kind is LayoutKind.LAYER_FIRST:
            return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        if self.kind is LayoutKind.RAW:
            return (self.bytes_per_block // self.dtype_bytes,)
        return (self.block_size, self.num_layers, 2, self.num_kv_heads, self.head_dim)

    def blocks_in(self, capacity_bytes: int) -> int:
        """Whole blocks that fit in ``capacity_bytes``."""
        return capacity_bytes // self.bytes_per_block

    @classmethod
    def from_model_config(
        cls, config: dict[str, Any], block_size: int = 16, dtype: str | None = None
    ) -> BlockLayout:
        """From a Hugging Face style config.json (Llama, Qwen, Mistral field names)."""
        try:
            layers = int(config["num_hidden_layers"])
            heads = int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"model config lacks attention sizes: {exc}") from exc
        chosen = dtype or str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        return cls(layers, kv_heads, head_dim, block_size, chosen)

    @classmethod
    def from_model_path(
        cls, model_path: str | Path, block_size: int = 16, dtype: str | None = None
    ) -> BlockLayout:
        path = Path(model_path)
        config_file = path / "config.json" if path.is_dir() else path
        try:
            config = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read model config {config_file}: {exc}") from exc
        return cls.from_model_config(config, block_size, dtype)
