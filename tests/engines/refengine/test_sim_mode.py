"""Simulated compute: same API, events and cache, no math; several replicas in one process."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.slow  # real processes, seconds a test


def test_replicas_serve_independently(h: Any) -> None:
    """--replicas 3: three ready lines, distinct ports, a cache each, the same outputs."""
    proc = h.start(
        "--compute",
        "sim",
        "--replicas",
        "3",
        "--speedup",
        "20",
        "--kv-events-config",
        h.EVENTS_CONFIG,
        replicas=3,
    )
    try:
        assert len({r["port"] for r in proc.ready}) == 3
        assert len({r["kv_events_endpoint"] for r in proc.ready}) == 3
        body = {"input_ids": list(range(50, 150)), "sampling_params": {"max_new_tokens": 6}}
        outs = [h.http("POST", r["url"] + "/generate", body)[1] for r in proc.ready]
        assert all(o["output_ids"] == outs[0]["output_ids"] for o in outs)
        assert all(len(o["output_ids"]) == 6 for o in outs)
        again = h.http("POST", proc.ready[1]["url"] + "/generate", body)[1]
        assert again["meta_info"]["cached_tokens"] == 96
        other = h.http("GET", proc.ready[2]["url"] + "/v1/loads")[1]["loads"][0]
        assert other["cache_hit_rate"] < 1.0
        info = h.http("GET", proc.ready[0]["url"] + "/server_info")[1]
        assert info["compute"] == "sim" and info["kv_events"]["block_size"] == 16
        status, out = h.http(
            "POST",
            proc.ready[0]["url"] + "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert status == 200 and out["usage"]["completion_tokens"] == 3
    finally:
        proc.stop()


def test_sim_host_tier_round_trip(h: Any) -> None:
    """In sim mode placeholder pages still go through the page store and count as loaded."""
    proc = h.start("--compute", "sim", "--speedup", "20", "--enable-hierarchical-cache")
    try:
        body = {"input_ids": list(range(1, 70)), "sampling_params": {"max_new_tokens": 2}}
        h.http("POST", proc.url + "/generate", body)
        assert h.http("POST", proc.url + "/flush_cache")[0] == 200
        out = h.http("POST", proc.url + "/generate", body)[1]
        assert out["meta_info"]["cached_tokens_details"]["storage"] == 64
    finally:
        proc.stop()


def test_bad_flags_fail_fast(h: Any) -> None:
    """Invalid configuration exits with status 2 and a message naming the flag."""
    import subprocess
    import sys

    for args, needle in (
        (["--replicas", "2"], "--compute sim"),
        (["--page-size", "0"], "--page-size"),
        (["--kv-events-config", "{bad"], "kv-events-config"),
        (["--disaggregation-mode", "prefill"], "hicache-storage-backend"),
    ):
        res = subprocess.run(
            [sys.executable, "-m", "refengine", *args],
            cwd=h.ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 2 and needle in res.stderr, (args, res.stderr)
