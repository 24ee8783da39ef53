"""The kvsidecar console script, run as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def kvs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsidecar", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_help_lists_commands() -> None:
    """`kvsidecar --help` lists every subcommand with a summary."""
    out = kvs("--help")
    assert out.returncode == 0
    assert "kv-size" in out.stdout and "up" in out.stdout


def test_unknown_command() -> None:
    """An unknown subcommand exits 2 with a message naming it."""
    out = kvs("frobnicate")
    assert out.returncode == 2 and "unknown command 'frobnicate'" in out.stderr


def test_kv_size_from_flags() -> None:
    """kv-size computes bytes per token and tier capacity from sizes (Llama-3-8B-like)."""
    out = kvs(
        "kv-size",
        "--num-layers",
        "32",
        "--num-kv-heads",
        "8",
        "--head-dim",
        "128",
        "--gpu-gib",
        "2",
    )
    assert out.returncode == 0, out.stderr
    assert "KV bytes per token: 131,072" in out.stdout
    assert "1,024" in out.stdout  # 2 GiB / 2 MiB per block


def test_kv_size_from_model_dir(tmp_path: Path) -> None:
    """kv-size reads a Hugging Face config.json."""
    config = {
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "hidden_size": 2048,
        "torch_dtype": "float16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = kvs("kv-size", "--model-path", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert f"KV bytes per token: {28 * 2 * 8 * 128 * 2:,}" in out.stdout


def test_kv_size_bad_config(tmp_path: Path) -> None:
    """A config without attention sizes is a clear error, not a traceback."""
    (tmp_path / "config.json").write_text("{}")
    out = kvs("kv-size", "--model-path", str(tmp_path))
    assert out.returncode == 2
    assert "model config lacks attention sizes" in out.stderr
    assert "Traceback" not in out.stderr
