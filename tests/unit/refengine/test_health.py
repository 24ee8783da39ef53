"""The engine's ``/health`` answers from its step loop's progress, not from a probe queued
behind its work (``refengine.heartbeat``): in process, a simulated engine behind its real app."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from refengine.config import EngineConfig
from refengine.engine import Engine
from refengine.launcher import load_model_config
from refengine.request import Phase, Request, SamplingParams
from refengine.server import build_app
from refengine.timing import SimTiming
from refengine.tokenizer import ChatTokenizer

MODEL = Path(__file__).resolve().parents[3] / "refengine" / "models" / "tiny"
PAGE = 16


@pytest.fixture
async def make_engine() -> AsyncIterator[Callable[..., Any]]:
    engines: list[Engine] = []

    async def make(pages: int, **sim: float) -> Engine:
        cfg = EngineConfig(model_path=MODEL, compute="sim",  # type: ignore[arg-type]
                           page_size=PAGE, max_total_tokens=pages * PAGE,
                           sim=SimTiming(**sim))
        tokenizer = ChatTokenizer.from_model_path(MODEL)
        engine = Engine(cfg, tokenizer, load_model_config(cfg, tokenizer.vocab_size))
        engines.append(await engine.__aenter__())
        return engine

    yield make
    for engine in engines:
        await engine.__aexit__(None, None, None)


def _request(rid: str, max_new_tokens: int) -> Request:
    return Request(rid, list(range(10, 10 + PAGE)), SamplingParams(max_new_tokens, 0.0))


async def test_a_busy_engine_is_healthy_while_its_queue_is_held(
        make_engine: Callable[..., Any], aiohttp_client: Any) -> None:
    """A running request holds the whole KV pool, so the next one waits at the head of the
    queue: /health answers 200 at once, with that request still waiting and nothing queued
    behind it (a probe queued there would wait for the whole running request)."""
    engine: Engine = await make_engine(pages=64)
    runner = _request("holder", max_new_tokens=64 * PAGE - PAGE)  # every page of the pool
    stream = engine.generate(runner)
    await anext(stream)  # its first token: it decodes now, holding the pool
    held = _request("held", max_new_tokens=8)
    engine.submit(held)
    client = await aiohttp_client(build_app(engine))
    resp = await client.get("/health")
    assert resp.status == 200
    assert held.phase is Phase.WAITING and runner.finish is None
    assert [r.rid for r in engine.scheduler.waiting] == ["held"]  # the probe queued nothing
    await stream.aclose()


async def test_a_stalled_step_makes_the_engine_unhealthy(
        make_engine: Callable[..., Any], aiohttp_client: Any) -> None:
    """The loop stuck inside a step never beats: /health answers 503 at its timeout."""
    engine: Engine = await make_engine(pages=8, sim_decode_base_ms=1e9)  # a decode step stalls
    runner = _request("stuck", max_new_tokens=4)
    stream = engine.generate(runner)
    await anext(stream)  # prefilled; its first decode step never ends
    client = await aiohttp_client(build_app(engine, health_timeout_s=0.2))
    resp = await client.get("/health")
    assert resp.status == 503
    assert runner.finish is None
    await stream.aclose()


async def test_an_idle_engine_answers_with_a_generation(
        make_engine: Callable[..., Any], aiohttp_client: Any) -> None:
    """Idle, the probe is a one-token generation (nothing else would run the loop), which
    the engine's request figures do not count."""
    engine: Engine = await make_engine(pages=8)
    client = await aiohttp_client(build_app(engine))
    beats = engine.heartbeat.beats
    resp = await client.get("/health")
    assert resp.status == 200
    assert engine.heartbeat.beats > beats and engine.stats.requests_finished == 0
