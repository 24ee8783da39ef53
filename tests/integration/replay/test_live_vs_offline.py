"""The offline model agrees with a live run: gateway (approx mode) + two reference engines.

Real processes on ephemeral ports: ``kvsidecar engine --compute sim --replicas 2`` (the
engine's own scheduler, prefix cache and timing model, no math) behind ``kvsidecar gateway``
in ``approx`` mode (placement from recently routed prefixes and load, no KV events: the only
prefix-aware mode a gateway without sidecars has). The same slice then runs through
``replay.offline`` with the same capacity, timing and speedup; hit rates must agree within a
few points. (kv mode with sidecar events: ``agreement_live_offline.py``, for ``kvsidecar up``.)
"""

from __future__ import annotations

import asyncio
import json
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
from tests.support.processes import log_event, ready_lines

ROOT = Path(__file__).resolve().parents[3]
TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
MODEL = ROOT / "refengine" / "models" / "tiny"
CAPACITY_TOKENS = 200_000
SPEEDUP = 20.0  # arrivals and the engines' timing both: the same system, 20× faster
CONTEXT = 8192  # the tiny model's max_position_embeddings
READY_S = 60.0


@pytest.mark.slow
async def test_approx_hit_rate_agrees_live_and_offline(tmp_path: Path) -> None:
    """The same 100 requests hit within 5 points live and offline (approx placement)."""
    records = [
        r
        for r in load_trace(TRACE, limit=600)
        if r.input_tokens + max(1, r.output_tokens) < CONTEXT - 64
    ][:100]
    ready = tmp_path / "engines.json"
    procs: list[asyncio.subprocess.Process] = []
    try:
        engines = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "refengine", "--compute", "sim", "--replicas", "2",
            "--port", "0", "--ready-file", str(ready), "--model-path", str(MODEL),
            "--max-total-tokens", str(CAPACITY_TOKENS), "--speedup", str(SPEEDUP),
            "--log-level", "warning", cwd=ROOT,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(engines)
        lines = await eventually(lambda: ready_lines(ready, engines, count=2), "the engines",
                                 READY_S, interval_s=0.05)
        urls = [json.loads(line)["url"] for line in lines]
        log = tmp_path / "gateway.log"
        with log.open("wb") as sink:
            gateway = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "routing", "--port", "0", "--router-mode", "approx",
                "--model-path", str(MODEL), "--block-size", "16",
                *[arg for url in urls for arg in ("--worker", url)],
                cwd=ROOT, stdout=sink, stderr=sink,
            )  # fmt: skip
        procs.append(gateway)
        started = await eventually(lambda: log_event(log, "gateway_started", gateway),
                                   f"the gateway to start (log: {log})", READY_S, 0.05)
        url = str(started["url"])
        live = await replay_live(
            records, TokenSynthesizer(1024), LiveConfig(url=url, model="tiny", speedup=SPEEDUP)
        )
    finally:
        for proc in reversed(procs):
            if proc.returncode is None:
                proc.terminate()
                await asyncio.wait_for(proc.wait(), 30)
    assert [r.error for r in live] == [None] * len(records)
    assert {r.worker for r in live} == set(urls)
    live_hit = sum(r.cached_tokens or 0 for r in live) / sum(r.input_tokens for r in live)
    cfg = FleetConfig(
        replicas=2,
        capacity_tokens=CAPACITY_TOKENS,
        timing=TimingModel(speedup=SPEEDUP),
        speedup=SPEEDUP,
    )
    offline = summarize("approx", outcomes(simulate(records, RouterMode.APPROX, cfg)))
    assert live_hit > 0.05  # the slice has real reuse to agree on
    assert abs(offline.hit_rate - live_hit) <= 0.05, (offline.hit_rate, live_hit)
