"""Model sizes: a ``config.json`` in the HF Llama shape, or a named preset that overrides it.

* ``tiny`` (the shipped default): a few ms per decode step on 2 CPU cores;
* ``kv-heavy``: 16 layers × 8 KV heads × head_dim 128 in float32 — 128 KiB of KV per token,
  the same as Llama-3-8B in bfloat16 — with a narrow residual stream so it still runs on a
  CPU. For benchmarks where KV bytes, not FLOPs, matter (offload, transfers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["PRESETS", "ModelConfig"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Decoder dimensions; field names follow HF's ``LlamaConfig``."""

    vocab_size: int
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 688
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    torch_dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model config {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.torch_dtype not in _DTYPE_BYTES:
            raise ValueError(
                f"torch_dtype {self.torch_dtype!r} unsupported; use one of {sorted(_DTYPE_BYTES)}"
            )

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.torch_dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        return (
            self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * self.dtype_bytes
        )

    def with_preset(self, name: str) -> ModelConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
        return replace(self, **PRESETS[name])

    @classmethod
    def from_model_path(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` from a model directory (HF Llama field names)."""
        file = Path(path) / "config.json"
        try:
            raw: dict[str, Any] = json.loads(file.read_text())
        except FileNotFoundError as exc:
            raise ValueError(f"model directory {path} has no config.json") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file} is not valid JSON: {exc}") from exc
        fields = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        if "head_dim" not in raw and "hidden_size" in raw and "num_attention_heads" in raw:
            fields["head_dim"] = int(raw["hidden_size"]) // int(raw["num_attention_heads"])
        extra = raw.get("refengine") or {}
        if "seed" in extra:
            fields["seed"] = int(extra["seed"])
        if "vocab_size" not in fields:
            raise ValueError(f"{file} lacks vocab_size")
        return cls(**fields)


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 688,
        "torch_dtype": "float32",
    },
    "kv-heavy": {
        "hidden_size": 256,
        "num_hidden_layers": 16,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 512,
        "torch_dtype": "float32",
    },
}
