"""Achieved vs achievable, end to end: a busy holder of a cached prefix loses on load, and
the reply, the metrics and ``kvsidecar top`` say so."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.stack.test_stack import Stack, start_stack, stop_stack, text
from tests.support.gateway import routable
from tests.support.polling import eventually

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def slow_stack(tmp_path: Path) -> Iterator[Stack]:
    """Two sim engines at real-time speed: a long generation stays in flight for seconds.
    Dynamo's weights, fixed: a holder busy decoding then costs more than its cached prefix
    saves (learned weights would price the same load by what TTFT shows)."""
    s = start_stack(tmp_path, speedup="1",
                    gateway_flags=("--overlap-weight", "1", "--prefill-load-scale", "1"))
    yield s
    stop_stack(s)


def _body(system: str, user: str, max_tokens: int, stream: bool = False) -> dict[str, object]:
    return {
        "model": "tiny",
        "max_tokens": max_tokens,
        "stream": stream,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


async def _metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as resp:
        raw = await resp.text()
    out = {}
    for family in text_string_to_metric_families(raw):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


@pytest.mark.slow
async def test_busy_holder_loses_on_load_and_top_shows_the_fleet(  # type: ignore[no-untyped-def]
    slow_stack, session
) -> None:
    url = slow_stack.url
    await routable(session, url, 2)
    system = text(3, 60)

    # 1. The prefix is cached on one worker, and the gateway knows it.
    async with session.post(f"{url}/v1/chat/completions", json=_body(system, "hello", 2)) as r:
        assert r.status == 200
        holder = r.headers["x-kvsidecar-worker"]
        await r.read()

    async def predicted_on_holder() -> int | None:
        async with session.post(f"{url}/v1/chat/completions", json=_body(system, "again", 2)) as r:
            assert r.status == 200
            await r.read()
            cached = int(r.headers["x-kvsidecar-cached-blocks"])
            if r.headers["x-kvsidecar-worker"] != holder or cached == 0:
                return None
            assert r.headers["x-kvsidecar-placement-reason"] == "best"
            assert int(r.headers["x-kvsidecar-best-overlap-blocks"]) == cached
            return cached

    cached = await eventually(predicted_on_holder, "the prefix predicted on its holder", 10, 0)

    # 2. The holder is made busy: a request sharing the prefix, with a long unique tail and a
    # long generation, rides the cache onto the holder and stays in flight there.
    busy = _body(system, text(50, 400), 4000, stream=True)
    held = await session.post(f"{url}/v1/chat/completions", json=busy)
    try:
        assert held.status == 200
        assert held.headers["x-kvsidecar-worker"] == holder
        await held.content.readline()  # the first event: prefilled, decoding now

        # 3. The same prefix now goes to the other worker, for the holder's load.
        async with session.post(f"{url}/v1/chat/completions", json=_body(system, "probe", 2)) as r:
            assert r.status == 200
            await r.read()
            assert r.headers["x-kvsidecar-worker"] != holder
            assert r.headers["x-kvsidecar-placement-reason"] == "load"
            best = int(r.headers["x-kvsidecar-best-overlap-blocks"])
            assert best >= cached > int(r.headers["x-kvsidecar-cached-blocks"])
    finally:
        held.close()  # the client goes away: the gateway aborts the held generation

    metrics = await _metrics(session, url)
    assert metrics["kvsidecar_gateway_placement_reason_total{reason=load}"] >= 1
    assert (
        metrics["kvsidecar_gateway_best_overlap_blocks_total{}"]
        > metrics["kvsidecar_gateway_chosen_overlap_blocks_total{}"]
    )
    assert metrics[f"kvsidecar_gateway_worker_prediction_checks_total{{worker={holder}}}"] >= 2
    assert metrics[f"kvsidecar_gateway_worker_actual_cached_tokens_total{{worker={holder}}}"] > 0
    assert metrics["kvsidecar_gateway_scorer_prefill_load_scale{}"] == 1.0
    assert metrics["kvsidecar_gateway_decode_interference_weight{}"] == 1.0
    assert "kvsidecar_gateway_decode_interference_moves_total{}" in metrics

    # 4. kvsidecar top prints both workers with their figures.
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "kvsidecar", "top", "--once", "--gateway", url],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"kvsidecar top — {url}  mode=kv  workers=2")
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("replica-")}
    assert set(rows) == {"replica-0", "replica-1"}
    head = lines[2].split()
    assert head[:5] == ["worker", "health", "parity", "in-flight", "reqs"]
    holder_row = rows[holder]
    assert holder_row[1] == "routable"
    cached_blocks, _, capacity = holder_row[5].partition("/")
    assert int(cached_blocks) > 0 and (capacity == "-" or int(capacity) >= int(cached_blocks))
    hit = holder_row[7]
    assert hit.endswith("%") and 0 < int(hit[:-1]) <= 100
    float(holder_row[8])  # the mean prediction error, signed tokens per request
    assert "placements by reason:" in lines[-2] and "load=" in lines[-2]
    # the scorer's weights (fixed here) and the decode-interference term, still learning
    assert lines[-1].startswith("scorer: overlap_weight=1  prefill_load_scale=1  decode ")
    itl_next = holder_row[9]  # ITL predicted with one more stream, once fitted
    assert itl_next == "-" or float(itl_next.removesuffix("ms")) > 0
