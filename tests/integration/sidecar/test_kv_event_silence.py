"""KV-event silence through real processes: reference engines (simulated compute), their
sidecars and a gateway. Repeats of a cached prompt never retire a worker (issue #28); an
engine that really publishes nothing is retired with its sidecar's reason, and comes back
once its events flow again."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvsidecar.launch import ManagedProcess
from tests.support.gateway import routable
from tests.support.net import ports_free
from tests.support.polling import eventually, wait_until
from tests.support.processes import ProcessGroup

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "refengine" / "models" / "tiny"
SILENT_S = "0.3"
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "What is the capital of France? " * 3}],
    "max_tokens": 8,
    "temperature": 0,
}


def events_config(pub: str = "tcp://127.0.0.1:*", replay: str = "tcp://127.0.0.1:*") -> str:
    return json.dumps({"publisher": "zmq", "endpoint": pub, "replay_endpoint": replay,
                       "topic": "kv"})


@pytest.fixture
def procs() -> Iterator[ProcessGroup[ManagedProcess]]:
    with ProcessGroup[ManagedProcess]() as group:
        yield group


def start(procs: ProcessGroup[ManagedProcess], tmp: Path, name: str, args: list[str],
          count: int = 1) -> ManagedProcess:
    proc = procs.add(ManagedProcess.start(name, args, workdir=tmp))
    proc.wait_ready(60, count=count)
    return proc


def engines(procs: ProcessGroup[ManagedProcess], tmp: Path, name: str, *flags: str,
            replicas: int = 1) -> ManagedProcess:
    return start(procs, tmp, name, ["refengine", "--compute", "sim", "--speedup", "20",
                                    "--replicas", str(replicas), *flags], count=replicas)


def sidecar(procs: ProcessGroup[ManagedProcess], tmp: Path, name: str, engine_url: str,
            *flags: str) -> ManagedProcess:
    return start(procs, tmp, name, ["sidecar", "--engine-url", engine_url, "--worker-id", name,
                                    "--port", "0", "--silent-after-s", SILENT_S, *flags])


def gateway(procs: ProcessGroup[ManagedProcess], tmp: Path,
            sidecars: list[ManagedProcess]) -> ManagedProcess:
    flags = [f for sc in sidecars for f in ("--sidecar", sc.url)]
    return start(procs, tmp, "gateway", ["routing", "--port", "0", "--model-path", str(MODEL),
                                         "--health-check-interval-s", "0.2", *flags])


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
    tmp_path: Path, procs: ProcessGroup[ManagedProcess], session: aiohttp.ClientSession
) -> None:
    """The issue's scenario: the same greedy chat three times, then a quiet many times
    --silent-after-s long: every worker stays routable and no canary was needed."""
    eng = engines(procs, tmp_path, "engines", "--port", "0", "--kv-events-config",
                  events_config(), replicas=2)
    sidecars = [sidecar(procs, tmp_path, f"replica-{i}", line["url"])
                for i, line in enumerate(eng.ready)]
    gw = gateway(procs, tmp_path, sidecars)
    await routable(session, gw.url, 2)
    answers = [await chat(session, gw.url) for _ in range(3)]
    assert answers[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # a cached prefix

    async def quiet_long_enough() -> list[dict[str, Any]]:
        views = [await health(session, sc.url) for sc in sidecars]
        ages = [v["kv_events"]["last_event_age_s"] for v in views]
        assert any(a is not None for a in ages), views  # the first chat's blocks came
        # Quiet for 5 x --silent-after-s: the old detector retired the worker after 1.
        assert all(a is None or a >= 5 * float(SILENT_S) for a in ages), views
        return views

    views = await eventually(quiet_long_enough, "a long quiet after the repeats", 20, 0.1)
    for view in views:
        assert view["http"] == 200 and view["routable"] is True, view
        assert view["kv_events"]["canaries_sent"] == 0, view
    listed = await routable(session, gw.url, 2)
    assert all(w["reason"] == "" for w in listed), listed
    await chat(session, gw.url)


async def test_an_engine_without_kv_events_is_retired_and_comes_back(
    tmp_path: Path, procs: ProcessGroup[ManagedProcess], session: aiohttp.ClientSession
) -> None:
    """No KV events: a chat that stores blocks, then a silent canary, retire the worker with
    the sidecar's reason at the gateway; the engine restarted with events is routable again,
    through the canary alone (no client request reaches a retired worker)."""
    # The event ports the engine will publish on once it is restarted with events: bound by
    # a first engine (read back, never guessed), which then goes away.
    first = engines(procs, tmp_path, "engine-0", "--port", "0", "--kv-events-config",
                    events_config())
    pub, replay = (first.ready[0][k] for k in ("kv_events_endpoint", "kv_replay_endpoint"))
    first.stop()
    quiet = engines(procs, tmp_path, "engine-1", "--port", "0")  # no --kv-events-config
    port = quiet.ready[0]["port"]
    sc = sidecar(procs, tmp_path, "replica-0", quiet.url, "--kv-events-endpoint", pub,
                 "--kv-events-replay-endpoint", replay, "--block-size", "16")
    gw = gateway(procs, tmp_path, [sc])
    await routable(session, gw.url, 1)
    await chat(session, gw.url)

    async def retired() -> dict[str, Any]:
        [worker] = await workers(session, gw.url)
        assert worker["routable"] is False, worker
        return worker

    worker = await eventually(retired, "the gateway to retire the silent worker", 20, 0.05)
    view = await health(session, sc.url)
    assert view["http"] == 503 and "published no KV event" in view["reason"], view
    assert worker["reason"] == view["reason"], (worker, view)
    assert view["kv_events"]["canaries_sent"] >= 1

    quiet.stop()
    ports = [pub, replay, f"tcp://127.0.0.1:{port}"]
    wait_until(lambda: ports_free(*ports), "the engine's ports to be free", 20)
    # Restarted as its operator would, with KV events, on the same ports (a host-less
    # `tcp://*:port` binds, as in SGLang).
    engines(procs, tmp_path, "engine-2", "--port", str(port), "--kv-events-config",
            events_config(*(f"tcp://*:{e.rsplit(':', 1)[1]}" for e in (pub, replay))))

    [back] = await routable(session, gw.url, 1, timeout_s=30)
    assert back["reason"] == "", back
    view = await health(session, sc.url)
    assert view["http"] == 200 and view["kv_events"]["silent"] is False, view
    assert view["kv_events"]["last_event_age_s"] is not None
    await chat(session, gw.url)
