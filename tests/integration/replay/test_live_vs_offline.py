"""The offline model agrees with a live run: gateway (approx mode) + two reference engines.

Real processes on ephemeral ports: ``kvsidecar engine --compute sim --replicas 2`` (the
engine's own scheduler, prefix cache and timing model, no math) behind ``kvsidecar gateway``
in ``approx`` mode (placement from recently routed prefixes and load, no KV events: the only
prefix-aware mode a gateway without sidecars has). The same slice then runs through
``replay.offline`` with the same capacity, timing and speedup; hit rates must agree within a
few points. (kv mode with sidecar events: ``agreement_live_offline.py``, for ``kvsidecar up``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsidecar.local_stack import EngineSpec, GatewaySpec, LocalStack, StackSpec
from refengine.timing import TimingModel
from replay.live import LiveConfig, replay_live
from replay.offline import FleetConfig, outcomes, simulate
from replay.summary import summarize
from replay.synthesis import TokenSynthesizer
from replay.traces import load_trace
from routing.config import RouterMode

ROOT = Path(__file__).resolve().parents[3]
TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
CAPACITY_TOKENS = 200_000
SPEEDUP = 20.0  # arrivals and the engines' timing both: the same system, 20× faster
CONTEXT = 8192  # the tiny model's max_position_embeddings


@pytest.mark.slow
async def test_approx_hit_rate_agrees_live_and_offline(tmp_path: Path) -> None:
    """The same 100 requests hit within 5 points live and offline (approx placement)."""
    records = [
        r
        for r in load_trace(TRACE, limit=600)
        if r.input_tokens + max(1, r.output_tokens) < CONTEXT - 64
    ][:100]
    spec = StackSpec(
        engines=(EngineSpec(replicas=2, sidecars=False),),
        gateways=(GatewaySpec(workers="engines", router_mode=RouterMode.APPROX.value,
                              args=("--block-size", "16")),),
        max_total_tokens=CAPACITY_TOKENS, speedup=SPEEDUP, log_level="warning")
    async with LocalStack(spec, tmp_path) as stack:
        urls = [part.url for part in stack.engines]
        live = await replay_live(
            records, TokenSynthesizer(1024),
            LiveConfig(url=stack.url, model="tiny", speedup=SPEEDUP))
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
