"""Two real vLLM CPU engines, started once for the module (each start costs a minute or
more): the real-engine benchmark's smoke run over them, then one of them killed mid-stream.

The stack: two vLLMs (48 blocks of 32 tokens, ``--enable-scale-out`` as vllm-router's
``kv_aware`` needs), a sidecar each and a gateway with ``--migration-limit``. The tests run
in file order; the last one kills an engine.

- ``scripts/bench_real_engine.py --engine-url ... --json`` with a tiny load: every pass's
  figures are sane and the ratios are there (the targets are the bench's to show).
- A stream placed on one vLLM (its prompt cached there first) whose whole process group is
  SIGKILLed after the first chunks goes on on the other to its full length, as one stream,
  as any worker's does (the continuation is not compared with an uninterrupted run's text:
  ``tests/integration/gateway/test_migration.py`` does that between torch reference engines,
  whose greedy tokens do not depend on how the prompt was batched).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvsidecar.launch import LaunchError
from kvsidecar.local_stack import EngineSpec, GatewaySpec, LocalStack, StackSpec
from kvsidecar.local_vllm import VLLM_BLOCK_SIZE, VllmOptions, VllmServer, tiny_model_with_weights
from tests.integration.disagg.pd_stack import metric
from tests.support.polling import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]
KV_BLOCKS = 48
PASSES = ("ours", "round_robin", "vllm_router_kv_aware", "vllm_router_cache_aware",
          "vllm_router_round_robin")
SESSIONS, TURNS = 4, 2
MAX_TOKENS = 32  # the CPU engine decodes a few tokens a second here
KILL_AFTER = 4  # chunks read before vLLM is killed


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """replica-0 and replica-1: vLLM servers, a sidecar each; one gateway that migrates."""
    model = tiny_model_with_weights()
    vllm = VllmOptions(model=model, kv_blocks=KV_BLOCKS,
                       max_model_len=(KV_BLOCKS - 1) * VLLM_BLOCK_SIZE,
                       extra_args=("--enable-scale-out",))  # vllm-router's kv_aware renders
    spec = StackSpec(
        engines=(EngineSpec(replicas=2, kind="vllm", vllm=vllm),),
        gateways=(GatewaySpec(args=("--block-size", str(VLLM_BLOCK_SIZE),
                                    "--migration-limit", "2")),),
        model_path=str(model),
    )
    try:
        with LocalStack(spec, tmp_path_factory.mktemp("vllm-pair")) as started:
            yield started
    except LaunchError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.mark.peers  # vllm-router is a test dependency: missing, the run fails saying so
def test_the_real_engine_bench_reports_every_pass_and_the_ratios(
    stack: LocalStack, tmp_path: Path
) -> None:
    """Four two-turn chats through each of the five front doors: every pass's figures,
    and ours against each other pass."""
    out = tmp_path / "real_engine.json"
    urls = [f for e in stack.engines for f in ("--engine-url", e.url)]
    run = subprocess.run(
        [sys.executable, "scripts/bench_real_engine.py", *urls, "--sessions", str(SESSIONS),
         "--turns", str(TURNS), "--system-words", "16", "--max-tokens", "2",
         "--concurrency", "2", "--workdir", str(tmp_path / "logs"), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=500,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    data = json.loads(out.read_text())
    assert set(data) == {"figures", "ratios"}
    figures = data["figures"]
    for name in PASSES:
        f = {k.removeprefix(f"{name}."): v for k, v in figures.items()
             if k.startswith(f"{name}.")}
        assert f["requests"] == SESSIONS * TURNS, (name, f)
        assert 0 <= f["cached_tokens"] < f["prompt_tokens"], (name, f)
        assert f["hit_rate"] == pytest.approx(f["cached_tokens"] / f["prompt_tokens"])
        assert 0 < f["ttft_p50_s"] <= f["ttft_p99_s"] < 120, (name, f)
        assert f["requests_per_s"] > 0 and f["output_tokens_per_s"] > 0, (name, f)
        assert 0.5 <= f["busiest_engine_share"] <= 1, (name, f)
    assert figures["ours.cached_tokens"] > 0  # second turns find their first turns' blocks
    # the gateway's own account: what it predicted cached, what the engines then reported
    assert figures["ours.chosen_overlap_blocks"] <= figures["ours.best_overlap_blocks"]
    assert figures["ours.predicted_cached_tokens"] > 0
    ratios = data["ratios"]
    for baseline in PASSES[1:]:
        for ratio in ("ttft_p50", "ttft_p99", "requests_per_s"):
            assert ratios[f"{ratio}_vs_{baseline}"] > 0
        hit_rate = f"hit_rate_vs_{baseline}"  # left out where the baseline hit nothing
        assert (ratios[hit_rate] > 0 if figures[f"{baseline}.cached_tokens"]
                else hit_rate not in ratios), (baseline, ratios)
    assert "vllm_router_kv_aware" in run.stdout and "(target >= 0.9)" in run.stdout


async def _cached_on(session: aiohttp.ClientSession, stack: LocalStack, worker: int,
                     tokens: list[int]) -> None:
    """Send ``tokens`` straight to one vLLM; wait until the gateway's index holds them
    there (its indexer API's ``/query``), so that placement follows them."""
    async with session.post(f"{stack.engines[worker].url}/v1/completions",
                            json={"model": "tiny", "prompt": tokens, "max_tokens": 1}) as resp:
        assert resp.status == 200, await resp.text()
    query = {"model": "tiny", "token_ids": tokens, "block_size": VLLM_BLOCK_SIZE}

    async def indexed() -> bool:
        async with session.post(f"{stack.url}/query", json=query) as resp:
            held = (await resp.json())["default"]
        matched = held.get(f"replica-{worker}", {}).get("longest_matched", 0)
        return bool(matched >= len(tokens) - VLLM_BLOCK_SIZE)

    await eventually(indexed, "the gateway to index the prompt on the vLLM", 30)


async def test_a_vllm_killed_mid_stream_migrates_its_stream(
    stack: LocalStack, session: aiohttp.ClientSession
) -> None:
    """SIGKILL to a vLLM after a few chunks: the stream ends on the other, whole. (Last:
    it leaves the module one engine.)"""
    prompt = [(i * 37) % 900 + 10 for i in range(10 * VLLM_BLOCK_SIZE)]
    await _cached_on(session, stack, 0, prompt)
    vllm = stack.engines[0].proc
    assert isinstance(vllm, VllmServer) and vllm.proc is not None
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    chunks: list[dict[str, Any]] = []
    done = False
    async with session.post(f"{stack.url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-kvsidecar-worker"] == "replica-0"  # its prompt is there
        async for line in resp.content:
            if line.strip() == b"data: [DONE]":
                done = True
                break
            if line.startswith(b"data:"):
                chunks.append(json.loads(line[5:]))
                if len(chunks) == KILL_AFTER:
                    os.killpg(vllm.proc.pid, signal.SIGKILL)

    assert done, "the stream ended without [DONE]"
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert usage["completion_tokens"] == MAX_TOKENS, usage
    assert finish[-1] == "length" and text, (finish[-1], text)
    assert len({c["id"] for c in chunks}) == 1  # one stream's chunks
    assert await metric(session, stack.url, "kvsidecar_gateway_migrations_total") == 1
    assert await metric(session, stack.url, "kvsidecar_gateway_streams_lost_total") == 0

    async def survivor_serves() -> bool:  # the dead worker has left placement
        async with session.post(f"{stack.url}/v1/completions",
                                json={"model": "tiny", "prompt": prompt, "max_tokens": 2}) as r:
            return r.status == 200 and r.headers["x-kvsidecar-worker"] == "replica-1"

    await eventually(survivor_serves, "the next request served by the survivor", 30)
