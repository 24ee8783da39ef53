"""The AIPerf harness's own parts, without AIPerf (a heavy environment of its own, run by
hand): the model directory laid out as an offline Hugging Face cache resolves to it, and the
trace slice fits the model's context."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.scripts import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_aiperf")


def test_the_model_directory_resolves_offline_as_a_cached_repo(
        bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import snapshot_download
    from tokenizers import Tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf-cache"
    repo = bench.hf_cache_layout(bench.MODEL, cache)
    assert repo == "kvsidecar/tiny"
    assert bench.hf_cache_layout(bench.MODEL, cache) == repo  # idempotent
    local = Path(snapshot_download(repo, local_files_only=True, cache_dir=cache))
    assert local.parent.parent.name == "models--kvsidecar--tiny"
    ours = Tokenizer.from_file(str(bench.MODEL / "tokenizer.json"))
    theirs = Tokenizer.from_file(str(local / "tokenizer.json"))
    assert theirs.encode("a prefix computed once").ids == ours.encode(
        "a prefix computed once").ids


def test_the_trace_slice_fits_the_context(bench: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "slice.jsonl"
    shape = bench.trace_slice(out, 50, 8192, 32, 0.25)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == shape["requests"] == 50 and rows[0]["timestamp"] == 0
    assert all(r["input_length"] + r["output_length"] <= 8192 and r["output_length"] <= 32
               and r["hash_ids"] for r in rows)
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
