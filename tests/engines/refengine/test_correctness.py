"""Greedy output is the same whatever the KV came from: computed, device-cached, loaded from the
host tier, or imported by another engine process (including the prefill → decode handoff)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # real processes, seconds a test

PROMPT = [(i * 37 + 11) % 1000 for i in range(203)]  # 12 full pages + 11 tokens
NEW = 24


def _gen(h: Any, url: str, ids: list[int], new: int = NEW, **extra: Any) -> dict[str, Any]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
        **extra,
    }
    status, out = h.http("POST", url + "/generate", body)
    assert status == 200, out
    return out


def _file_store(path: Path) -> list[str]:
    return [
        "--hicache-storage-backend",
        "file",
        "--hicache-storage-backend-extra-config",
        json.dumps({"file_path": str(path)}),
    ]


def test_prefix_hit_does_not_change_greedy_output(h: Any, engine: Any) -> None:
    """Same tokens cold and with a 12-page device prefix hit."""
    cold = _gen(h, engine.url, PROMPT)
    warm = _gen(h, engine.url, PROMPT)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["meta_info"]["cached_tokens"] == 192
    assert warm["meta_info"]["cached_tokens_details"] == {"device": 192, "host": 0, "storage": 0}
    assert warm["output_ids"] == cold["output_ids"]


def test_host_tier_load_and_cross_process_import(h: Any, engine: Any, tmp_path: Path) -> None:
    """Written-through pages load after a flush and in another process; outputs stay the same."""
    reference = _gen(h, engine.url, PROMPT)["output_ids"]
    store = tmp_path / "pages"
    first = h.start(*_file_store(store))
    try:
        assert _gen(h, first.url, PROMPT)["output_ids"] == reference
        assert len(list(store.glob("*.bin"))) >= 12  # written through
        assert h.http("POST", first.url + "/flush_cache")[0] == 200
        loaded = _gen(h, first.url, PROMPT)
        assert loaded["meta_info"]["cached_tokens_details"]["storage"] == 192
        assert loaded["meta_info"]["cached_tokens_details"]["device"] == 0
        assert loaded["output_ids"] == reference
    finally:
        first.stop()
    second = h.start(*_file_store(store))
    try:
        imported = _gen(h, second.url, PROMPT)
        assert imported["meta_info"]["cached_tokens_details"]["storage"] == 192
        assert imported["output_ids"] == reference
        longer = _gen(h, second.url, PROMPT + reference[:5], new=4)
        assert longer["meta_info"]["cached_tokens"] >= 192
    finally:
        second.stop()


def test_prefill_role_hands_pages_to_decode_role(h: Any, engine: Any, tmp_path: Path) -> None:
    """Prefill exports its pages and first token; decode imports them and continues as agg."""
    reference = _gen(h, engine.url, PROMPT)["output_ids"]
    store = tmp_path / "pd"
    prefill = h.start(*_file_store(store), "--disaggregation-mode", "prefill")
    decode = h.start(*_file_store(store), "--disaggregation-mode", "decode")
    try:
        p = _gen(h, prefill.url, PROMPT)
        assert p["output_ids"] == reference[:1]
        transfer = p["meta_info"]["kv_transfer"]
        assert transfer["num_pages"] == 12 and len(transfer["page_keys"]) == 12
        d = _gen(
            h,
            decode.url,
            PROMPT + p["output_ids"],
            new=NEW - 1,
            kv_transfer={"page_keys": transfer["page_keys"]},
        )
        assert d["meta_info"]["cached_tokens_details"]["storage"] == 192
        assert p["output_ids"] + d["output_ids"] == reference
        again = _gen(h, prefill.url, PROMPT)  # a device-cache hit still reports the export
        assert again["meta_info"]["kv_transfer"]["page_keys"] == transfer["page_keys"]
        # A decode request whose pages were never exported is refused, not recomputed.
        status, out = h.http(
            "POST",
            decode.url + "/generate",
            {"input_ids": [3] * 100, "sampling_params": {"max_new_tokens": 2}},
        )
        assert status == 409 and "imported" in out["error"]["message"]
        status, out = h.http(
            "POST",
            decode.url + "/generate",
            {
                "input_ids": PROMPT,
                "kv_transfer": {"page_keys": ["00" * 32]},
                "sampling_params": {"max_new_tokens": 2},
            },
        )
        assert status == 400 and "do not match" in out["error"]["message"]
    finally:
        prefill.stop()
        decode.stop()
