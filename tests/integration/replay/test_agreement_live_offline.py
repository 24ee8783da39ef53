"""Live vs offline agreement on a trace slice, against the local stack (simulated engines).

What it checks (issue 8, tests): the same slice replayed live through gateway → sidecars →
reference engines (sim compute: the engine's scheduler and cache, timed by its timing model)
and offline through ``replay.offline`` gives hit rates within a few points.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from refengine.timing import TimingModel
from replay.live import LiveConfig, replay_live
from replay.offline import FleetConfig, outcomes, simulate
from replay.summary import summarize
from replay.synthesis import TokenSynthesizer
from replay.traces import load_trace
from routing.config import RouterMode
from tests.support.polling import eventually
from tests.support.processes import ready_lines

ROOT = Path(__file__).resolve().parents[3]
TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
REPLICAS = 2
CAPACITY_TOKENS = 200_000
SPEEDUP = 20.0  # arrivals and engine timing both ×20: the same system, 20× faster
MAX_PROMPT = 8192  # prompt + answer within the default model's context
STARTUP_S = 90.0


async def _start_stack(tmp_path: Path) -> tuple[asyncio.subprocess.Process, str]:
    ready = tmp_path / "ready.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvsidecar", "up",
        "--compute", "sim", "--replicas", str(REPLICAS),
        "--max-total-tokens", str(CAPACITY_TOKENS), "--speedup", str(SPEEDUP),
        "--router-mode", "kv", "--port", "0", "--ready-file", str(ready),
        cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    lines = await eventually(lambda: ready_lines(ready, proc), "kvsidecar up to become ready",
                             STARTUP_S, interval_s=0.1)
    return proc, json.loads(lines[0])["url"]


@pytest.mark.slow
async def test_offline_hit_rate_agrees_with_the_live_stack(tmp_path: Path) -> None:
    """kv placement hits within 5 points live and offline on the same 80-request slice."""
    records = [
        r for r in load_trace(TRACE, limit=200) if r.input_tokens + r.output_tokens <= MAX_PROMPT
    ][:80]
    proc, url = await _start_stack(tmp_path)
    try:
        live = await replay_live(
            records, TokenSynthesizer(1024), LiveConfig(url=url, speedup=SPEEDUP)
        )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
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
