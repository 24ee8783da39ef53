"""The sidecar's engine probe: a probe that times out while the engine's output advances
keeps the engine healthy; an answer other than 200, or no engine, does not. The engine is a
fake at the engine boundary whose ``/health`` is held by a gate."""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sidecar.engine_watch import EngineWatch

_TIMEOUT_S = 0.2  # the probe's: the gate is never opened before it


class GatedEngine:
    """``/health`` waits for ``gate`` (never opened here: a probe queued behind work), or
    answers ``status`` when ``held`` is False; ``arrived`` is set when a probe comes in."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.arrived = asyncio.Event()
        self.held = True
        self.status = 200

    async def health(self, request: web.Request) -> web.Response:
        self.arrived.set()
        if self.held:
            await self.gate.wait()
        return web.Response(status=self.status)


@pytest.fixture
async def engine(aiohttp_server: Any) -> AsyncIterator[tuple[GatedEngine, str]]:
    fake = GatedEngine()
    app = web.Application()
    app.router.add_get("/health", fake.health)
    server = await aiohttp_server(app)
    yield fake, f"http://127.0.0.1:{server.port}"
    fake.gate.set()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def _check_with_progress(watch: EngineWatch, fake: GatedEngine, output: list[int]) -> bool:
    """One probe, during which the engine produces a token (after the probe arrived)."""
    probe = asyncio.create_task(watch.check())
    await fake.arrived.wait()
    output[0] += 1  # a token relayed while the probe waits
    return await probe


async def test_a_slow_probe_keeps_a_working_engine_healthy(
        engine: tuple[GatedEngine, str], session: aiohttp.ClientSession) -> None:
    """The probe times out, but tokens flowed meanwhile: still healthy, counted as slow."""
    fake, url = engine
    watch = EngineWatch(session, url, probe_timeout_s=_TIMEOUT_S)
    watch.healthy = True  # as after start-up
    output = [0]
    watch.progress = lambda: output[0]
    assert await _check_with_progress(watch, fake, output) is True
    assert watch.healthy and watch.slow_probes == 1


async def test_a_slow_probe_with_nothing_flowing_retires_the_engine(
        engine: tuple[GatedEngine, str], session: aiohttp.ClientSession) -> None:
    """The probe times out and the engine produced nothing: unhealthy."""
    fake, url = engine
    watch = EngineWatch(session, url, probe_timeout_s=_TIMEOUT_S)
    watch.healthy = True
    assert await watch.check() is False
    assert fake.arrived.is_set() and watch.slow_probes == 0


async def test_progress_does_not_overrule_an_engine_that_says_unhealthy(
        engine: tuple[GatedEngine, str], session: aiohttp.ClientSession) -> None:
    """A 503 is the engine's own verdict, whatever flows; a 200 brings it back."""
    fake, url = engine
    fake.held, fake.status = False, 503
    watch = EngineWatch(session, url, probe_timeout_s=_TIMEOUT_S)
    watch.healthy = True
    output = [0]
    watch.progress = lambda: output[0]
    assert await _check_with_progress(watch, fake, output) is False
    fake.status = 200
    assert await watch.check() is True


async def test_a_slow_probe_does_not_revive_an_unhealthy_engine(
        engine: tuple[GatedEngine, str], session: aiohttp.ClientSession) -> None:
    """Progress keeps the last verdict; only a 200 makes an unhealthy engine healthy."""
    fake, url = engine
    watch = EngineWatch(session, url, probe_timeout_s=_TIMEOUT_S)
    output = [0]
    watch.progress = lambda: output[0]
    assert await _check_with_progress(watch, fake, output) is False


async def test_no_engine_is_unhealthy(session: aiohttp.ClientSession) -> None:
    """Nothing listening (a port bound, not listened on): unhealthy, whatever flows."""
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        watch = EngineWatch(session, f"http://127.0.0.1:{bound.getsockname()[1]}",
                            probe_timeout_s=_TIMEOUT_S)
        watch.healthy = True
        watch.progress = itertools.count().__next__  # advances at every read
        assert await watch.check() is False
