"""KV-event silence through real processes: reference engines (simulated compute), their
sidecars and a gateway. Repeats of a cached prompt never retire a worker (issue #28); an
engine that really publishes nothing is retired with its sidecar's reason, and comes back
once its events flow again."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvsidecar.local_stack import EngineSpec, ExternalPublisher, GatewaySpec, LocalStack, StackSpec
from tests.support.gateway import routable
from tests.support.net import ports_free
from tests.support.polling import eventually, wait_until

pytestmark = pytest.mark.slow

SILENT_S = "0.3"
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "What is the capital of France? " * 3}],
    "max_tokens": 8,
    "temperature": 0,
}
NO_EVENTS = json.dumps({"publisher": "null"})  # SGLang's default: the engine publishes nothing


def events_config(pub: str = "tcp://127.0.0.1:*", replay: str = "tcp://127.0.0.1:*") -> str:
    return json.dumps({"publisher": "zmq", "endpoint": pub, "replay_endpoint": replay,
                       "topic": "kv"})


def stack_spec(engine: EngineSpec, events: str, *, gateway: bool = True) -> StackSpec:
    """Simulated ``engine``s (speedup 20) with KV ``events``, each sidecar silent after
    ``SILENT_S``, and (``gateway``) a gateway probing them every 0.2 s."""
    return StackSpec(engines=(engine,), speedup=20, events_config=events,
                     sidecar_args=("--silent-after-s", SILENT_S),
                     gateways=(GatewaySpec(health_check_interval_s=0.2),) if gateway else ())


async def chat(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
        body: dict[str, Any] = await resp.json()
        assert resp.status == 200, body
        return body


async def health(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/health") as resp:
        body: dict[str, Any] = await resp.json()
        return {"http": resp.status, **body}


async def workers(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with session.get(f"{url}/v1/workers") as resp:
        return list((await resp.json())["workers"])


async def test_repeats_of_a_cached_chat_never_retire_a_worker(
    tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    """The issue's scenario: the same greedy chat three times, then a quiet many times
    --silent-after-s long: every worker stays routable and no canary was needed."""
    spec = stack_spec(EngineSpec(replicas=2), events_config())
    async with LocalStack(spec, tmp_path) as stack:
        sidecars, gw = [p.url for p in stack.sidecars], stack.url
        await routable(session, gw, 2)
        answers = [await chat(session, gw) for _ in range(3)]
        cached = answers[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0  # a cached prefix

        async def quiet_long_enough() -> list[dict[str, Any]]:
            views = [await health(session, url) for url in sidecars]
            ages = [v["kv_events"]["last_event_age_s"] for v in views]
            assert any(a is not None for a in ages), views  # the first chat's blocks came
            # Quiet for 5 x --silent-after-s: the old detector retired the worker after 1.
            assert all(a is None or a >= 5 * float(SILENT_S) for a in ages), views
            return views

        views = await eventually(quiet_long_enough, "a long quiet after the repeats", 20, 0.1)
        for view in views:
            assert view["http"] == 200 and view["routable"] is True, view
            assert view["kv_events"]["canaries_sent"] == 0, view
        listed = await routable(session, gw, 2)
        assert all(w["reason"] == "" for w in listed), listed
        await chat(session, gw)


async def test_an_engine_without_kv_events_is_retired_and_comes_back(
    tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    """No KV events: a chat that stores blocks, then a silent canary, retire the worker with
    the sidecar's reason at the gateway; the engine restarted with events is routable again,
    through the canary alone (no client request reaches a retired worker)."""
    # The event ports the engine will publish on once it is restarted with events: bound by
    # a first engine (read back, never guessed), which then goes away.
    first = stack_spec(EngineSpec(sidecars=False), events_config(), gateway=False)
    with LocalStack(first, tmp_path / "first") as stack:
        pub, replay = (stack.engines[0].ready[k] for k in ("kv_events_endpoint",
                                                           "kv_replay_endpoint"))
    # The engine publishes nothing; its sidecar listens where the first one published.
    heard = ExternalPublisher(events=pub, replay=replay)
    quiet = stack_spec(EngineSpec(publisher=heard, sidecar_args=("--block-size", "16")),
                       NO_EVENTS)
    async with LocalStack(quiet, tmp_path) as stack:
        sc, gw = stack.sidecars[0].url, stack.url
        await routable(session, gw, 1)
        await chat(session, gw)

        async def retired() -> dict[str, Any]:
            [worker] = await workers(session, gw)
            assert worker["routable"] is False, worker
            return worker

        worker = await eventually(retired, "the gateway to retire the silent worker", 20, 0.05)
        view = await health(session, sc)
        assert view["http"] == 503 and "published no KV event" in view["reason"], view
        assert worker["reason"] == view["reason"], (worker, view)
        assert view["kv_events"]["canaries_sent"] >= 1

        engine = stack.process("replica-0")
        engine.stop()
        ports = [pub, replay, f"tcp://127.0.0.1:{engine.ready[0]['port']}"]
        wait_until(lambda: ports_free(*ports), "the engine's ports to be free", 20)
        # Restarted as its operator would, with KV events, on the same ports (a host-less
        # `tcp://*:port` binds, as in SGLang); the stack gives it back its HTTP port.
        events = events_config(*(f"tcp://*:{e.rsplit(':', 1)[1]}" for e in (pub, replay)))
        await asyncio.to_thread(stack.restart, engine, "--kv-events-config", events)

        [back] = await routable(session, gw, 1, timeout_s=30)
        assert back["reason"] == "", back
        view = await health(session, sc)
        assert view["http"] == 200 and view["kv_events"]["silent"] is False, view
        assert view["kv_events"]["last_event_age_s"] is not None
        await chat(session, gw)
