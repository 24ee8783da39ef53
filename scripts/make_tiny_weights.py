"""Write a model directory a real engine (vLLM) loads: the reference engine's config and
tokenizer plus ``model.safetensors`` holding the very weights the reference engine draws from
its seed, under HF Llama's tensor names. Deterministic: the same inputs give the same bytes.

The directory lands in a cache (default ``<repo>/.cache/models/<key>/<name>``, gitignored:
the model keeps its name, which the gateway and vLLM serve it under), keyed on the source
directory's files and this script, and is written atomically; run again with nothing changed
and it only prints the path.

    python scripts/make_tiny_weights.py [--model refengine/models/tiny] [--cache-dir DIR]

Prints the directory's path on stdout. Needs torch and safetensors (the project's ``.venv``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def cache_key(model: Path) -> str:
    """16 hex digits over the source files and this script."""
    digest = hashlib.sha256()
    for name in (*_FILES, Path(__file__).name):
        path = Path(__file__) if name == Path(__file__).name else model / name
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def hf_state_dict(model: Path) -> dict[str, Any]:
    """The reference engine's seeded weights under HF ``LlamaForCausalLM`` names."""
    sys.path.insert(0, str(ROOT))
    from refengine.model import LlamaModel
    from refengine.presets import ModelConfig

    cfg = ModelConfig.from_model_path(model)
    ref = LlamaModel(cfg)
    hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    out: dict[str, Any] = {
        "model.embed_tokens.weight": ref.embed.weight,
        "model.norm.weight": ref.norm.weight,
        "lm_head.weight": ref.lm_head.weight,
    }
    for i, layer in enumerate(ref._blocks):
        p = f"model.layers.{i}."
        q, k, v = layer.qkv.weight.split([nh * hd, nkv * hd, nkv * hd], dim=0)
        gate, up = layer.gate_up.weight.chunk(2, dim=0)
        out |= {
            p + "input_layernorm.weight": layer.input_norm.weight,
            p + "self_attn.q_proj.weight": q,
            p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": layer.o_proj.weight,
            p + "post_attention_layernorm.weight": layer.post_norm.weight,
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": layer.down.weight,
        }
    return {name: t.contiguous().clone() for name, t in out.items()}


def build(model: Path, cache_dir: Path) -> Path:
    """The cached model directory for ``model``, written first if absent."""
    target = cache_dir / cache_key(model) / model.name
    if (target / "model.safetensors").exists():
        return target
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for name in _FILES:
            shutil.copyfile(model / name, tmp / name)
        save_file(hf_state_dict(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.rename(tmp, target)
    except OSError:
        if (target / "model.safetensors").exists():  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
            return target
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "refengine" / "models" / "tiny",
                        help="the reference engine's model directory")
    parser.add_argument("--cache-dir", type=Path, default=ROOT / ".cache" / "models",
                        help="where the directory with weights is written")
    args = parser.parse_args(argv)
    print(build(args.model.resolve(), args.cache_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
