"""Live vs offline agreement on a trace slice, against the local stack (simulated engines).

What it checks (issue 8, tests): the same slice replayed live through gateway → sidecars →
reference engines (sim compute: the engine's scheduler and cache, timed by its timing model)
and offline through ``replay.offline`` gives hit rates within a few points.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvsidecar.launch import ManagedProcess
from refengine.timing import TimingModel
from replay.live import LiveConfig, replay_live
from replay.offline import FleetConfig, outcomes, simulate
from replay.summary import summarize
from replay.synthesis import TokenSynthesizer
from replay.traces import load_trace
from routing.config import RouterMode

ROOT = Path(__file__).resolve().parents[3]
TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
REPLICAS = 2
CAPACITY_TOKENS = 200_000
SPEEDUP = 20.0  # arrivals and engine timing both ×20: the same system, 20× faster
MAX_PROMPT = 8192  # prompt + answer within the default model's context
STARTUP_S = 90.0


def _start_stack(tmp_path: Path) -> ManagedProcess:
    """``kvsidecar up`` itself (the command under test, not ``LocalStack`` in the test), once
    its gateway serves; it stops its stack on SIGTERM."""
    up = ManagedProcess.start("up", [
        "kvsidecar", "up", "--compute", "sim", "--replicas", str(REPLICAS),
        "--max-total-tokens", str(CAPACITY_TOKENS), "--speedup", str(SPEEDUP),
        "--router-mode", "kv", "--port", "0"], workdir=tmp_path)
    up.wait_ready(STARTUP_S)
    return up


@pytest.mark.slow
async def test_offline_hit_rate_agrees_with_the_live_stack(tmp_path: Path) -> None:
    """kv placement hits within 5 points live and offline on the same 80-request slice."""
    records = [
        r for r in load_trace(TRACE, limit=200) if r.input_tokens + r.output_tokens <= MAX_PROMPT
    ][:80]
    up = await asyncio.to_thread(_start_stack, tmp_path)
    try:
        live = await replay_live(
            records, TokenSynthesizer(1024), LiveConfig(url=up.url, speedup=SPEEDUP)
        )
    finally:
        await asyncio.to_thread(up.stop)
    assert [r.error for r in live] == [None] * len(records)
    live_hit = sum(r.cached_tokens or 0 for r in live) / sum(r.input_tokens for r in live)
    cfg = FleetConfig(
        replicas=REPLICAS,
        capacity_tokens=CAPACITY_TOKENS,
        timing=TimingModel(speedup=SPEEDUP),
        speedup=SPEEDUP,
    )
    offline = summarize("kv", outcomes(simulate(records, RouterMode.KV, cfg)))
    assert abs(offline.hit_rate - live_hit) <= 0.05, (offline.hit_rate, live_hit)
