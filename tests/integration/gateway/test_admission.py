"""Admission control end to end: requests wait for a busy worker (highest priority first,
then by their tenants' fair shares), give up with 503 and retry-after, are refused with 429
and retry-after when the queue is full (the flooding tenant's, when another's arrives); each
refusal names its reason; a bad priority is a 400; a session stays on its worker."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from pathlib import Path

import orjson
import pytest

from tests.support import gateway_http as h
from tests.support.polling import eventually

pytestmark = pytest.mark.slow  # real processes, seconds a test

BUSY = ("--router-mode", "least-loaded", "--max-in-flight-per-worker", "1")


async def _hold(port: int, key: bytes | None = None) -> asyncio.StreamWriter:
    """A stream that takes the worker's one slot until its writer is closed."""
    raw = orjson.dumps(h.chat(stream=True, fake_hang=True))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    auth = b"" if key is None else b"authorization: Bearer %s\r\n" % key
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n%scontent-type: "
                 b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (auth, len(raw), raw))
    async with asyncio.timeout(10):
        assert (await reader.readuntil(b"data: ")).startswith(b"HTTP/1.1 200")
    return writer


async def _metric(url: str, name: str) -> float:
    _, text = await h.get(url, "/metrics")
    found = re.search(rb"^kvsidecar_gateway_" + re.escape(name.encode()) + rb" (\S+)$", text,
                      re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def _waiting(url: str, n: int) -> None:
    async def check() -> bool:
        return await _metric(url, "admission_waiting") == n

    await eventually(check, f"{n} requests waiting", 10.0)


async def test_waiting_requests_are_served_highest_priority_first(spawn) -> None:  # type: ignore[no-untyped-def]
    engine = spawn.engine()
    gateway = spawn.gateway([engine], *BUSY, "--queue-timeout-s", "60")
    holder = await _hold(gateway.port)
    done: list[str] = []

    async def ask(name: str, priority: int) -> None:
        status, headers, _ = await h.post(
            gateway.url, "/v1/chat/completions", h.chat(max_tokens=4, fake_delay_s=0.01),
            {"x-kvsidecar-priority": str(priority)})
        assert status == 200, name
        assert headers["x-kvsidecar-worker"] == engine.url
        done.append(name)

    tasks = []
    for n, (name, priority) in enumerate((("low-1", 0), ("high", 5), ("low-2", 0))):
        tasks.append(asyncio.ensure_future(ask(name, priority)))
        await _waiting(gateway.url, n + 1)
    holder.close()  # the slot frees: the queue's head goes, then the next, one at a time
    await asyncio.gather(*tasks)
    assert done == ["high", "low-1", "low-2"]
    _, text = await h.get(gateway.url, "/metrics")
    assert b'kvsidecar_gateway_admission_requests_total{outcome="admitted"} 3.0' in text
    assert await _metric(gateway.url, "admission_waiting") == 0


async def test_a_request_that_waits_too_long_gets_503_with_retry_after(spawn) -> None:  # type: ignore[no-untyped-def]
    engine = spawn.engine()
    gateway = spawn.gateway([engine], *BUSY, "--queue-timeout-s", "0.3")
    holder = await _hold(gateway.port)
    status, headers, body = await h.post(gateway.url, "/v1/chat/completions", h.chat())
    assert status == 503 and headers["retry-after"] == "1"
    assert headers["x-kvsidecar-shed-reason"] == "queue_timeout"
    error = orjson.loads(body)["error"]
    assert error["code"] == "service_unavailable" and "--queue-timeout-s" in error["message"]
    holder.close()
    _, text = await h.get(gateway.url, "/metrics")
    assert b'kvsidecar_gateway_admission_requests_total{outcome="expired"} 1.0' in text


async def test_a_full_queue_refuses_at_once_and_a_gone_client_leaves_it(spawn) -> None:  # type: ignore[no-untyped-def]
    engine = spawn.engine()
    gateway = spawn.gateway([engine], *BUSY, "--queue-timeout-s", "60", "--queue-max", "1")
    holder = await _hold(gateway.port)
    waiting = asyncio.ensure_future(h.post(gateway.url, "/v1/chat/completions", h.chat()))
    await _waiting(gateway.url, 1)
    status, headers, body = await h.post(gateway.url, "/v1/chat/completions", h.chat())
    assert status == 429 and headers["retry-after"] == "60"
    assert headers["x-kvsidecar-shed-reason"] == "queue_full"
    assert "1 requests are already waiting" in orjson.loads(body)["error"]["message"]
    waiting.cancel()  # its client goes away while it waits
    await _waiting(gateway.url, 0)
    holder.close()
    status, _, _ = await h.post(gateway.url, "/v1/chat/completions", h.chat())
    assert status == 200
    _, text = await h.get(gateway.url, "/metrics")
    assert b'kvsidecar_gateway_admission_requests_total{outcome="full"} 1.0' in text


async def test_without_a_queue_a_busy_fleet_answers_429_with_retry_after(spawn) -> None:  # type: ignore[no-untyped-def]
    engine = spawn.engine()
    gateway = spawn.gateway([engine], *BUSY)
    holder = await _hold(gateway.port)
    status, headers, _ = await h.post(gateway.url, "/v1/chat/completions", h.chat())
    assert status == 429 and headers["retry-after"] == "1"
    assert headers["x-kvsidecar-shed-reason"] == "busy"
    holder.close()


def _tenants(tmp_path: Path) -> Path:
    keys = tmp_path / "keys.txt"
    keys.write_text("flood-key flood\nquiet-key quiet weight=1\n")
    return keys


async def test_a_quiet_tenant_passes_a_flooding_tenants_backlog(spawn, tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = spawn.engine()
    gateway = spawn.gateway([engine], *BUSY, "--queue-timeout-s", "60",
                            "--api-key-file", str(_tenants(tmp_path)))
    holder = await _hold(gateway.port, b"flood-key")
    done: list[str] = []

    async def ask(name: str, key: str) -> None:
        status, _, body = await h.post(
            gateway.url, "/v1/chat/completions", h.chat(max_tokens=4, fake_delay_s=0.01),
            {"authorization": f"Bearer {key}"})
        assert status == 200, (name, body)
        done.append(name)

    tasks = []
    for n, (name, key) in enumerate((("f1", "flood-key"), ("f2", "flood-key"),
                                     ("f3", "flood-key"), ("q1", "quiet-key"))):
        tasks.append(asyncio.ensure_future(ask(name, key)))
        await _waiting(gateway.url, n + 1)
    holder.close()
    await asyncio.gather(*tasks)
    assert done == ["f1", "q1", "f2", "f3"]  # q1 came last and is served second


async def test_a_full_queue_sheds_the_flooding_tenants_newest(spawn, tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = spawn.engine()
    gateway = spawn.gateway([engine], *BUSY, "--queue-timeout-s", "60", "--queue-max", "2",
                            "--api-key-file", str(_tenants(tmp_path)))
    holder = await _hold(gateway.port, b"flood-key")
    flood = {"authorization": "Bearer flood-key"}
    first = asyncio.ensure_future(h.post(gateway.url, "/v1/chat/completions", h.chat(), flood))
    await _waiting(gateway.url, 1)
    newest = asyncio.ensure_future(h.post(gateway.url, "/v1/chat/completions", h.chat(), flood))
    await _waiting(gateway.url, 2)
    quiet = asyncio.ensure_future(h.post(gateway.url, "/v1/chat/completions", h.chat(),
                                         {"authorization": "Bearer quiet-key"}))
    status, headers, body = await newest
    assert status == 429 and headers["x-kvsidecar-shed-reason"] == "fair_share"
    assert headers["retry-after"] == "60"
    assert "tenant 'flood' is over its fair share" in orjson.loads(body)["error"]["message"]
    holder.close()
    assert (await first)[0] == 200 and (await quiet)[0] == 200
    assert await _metric(gateway.url, 'admission_requests_total{outcome="shed"}') == 1


async def test_a_bad_priority_is_refused_and_names_the_header(spawn) -> None:  # type: ignore[no-untyped-def]
    engine = spawn.engine()
    gateway = spawn.gateway([engine], *BUSY, "--queue-timeout-s", "5")
    for bad in ("high", "99999"):
        status, _, body = await h.post(gateway.url, "/v1/chat/completions", h.chat(),
                                       {"x-kvsidecar-priority": bad})
        error = orjson.loads(body)["error"]
        assert status == 400 and error["param"] == "x-kvsidecar-priority", error
    assert (await h.post(gateway.url, "/v1/chat/completions", h.chat()))[0] == 200


async def test_a_session_stays_on_its_worker(spawn) -> None:  # type: ignore[no-untyped-def]
    engines = [spawn.engine(), spawn.engine()]
    gateway = spawn.gateway(engines, "--router-mode", "round-robin", "--session-affinity")
    served: dict[str, Counter[str]] = {"s1": Counter(), "s2": Counter()}
    reasons = Counter()
    for i in range(8):
        session = "s1" if i % 2 else "s2"
        status, headers, _ = await h.post(gateway.url, "/v1/chat/completions",
                                          h.chat(f"turn {i}"), {"x-session-id": session})
        assert status == 200
        served[session][headers["x-kvsidecar-worker"]] += 1
        reasons[headers.get("x-kvsidecar-placement-reason", "")] += 1
    assert [len(c) for c in served.values()] == [1, 1]  # each session on one worker
    assert reasons["affinity"] == 6  # all but each session's first request
    assert await _metric(gateway.url, "session_affinity_hits_total") == 6
    # Without the header, round-robin as before.
    workers = Counter()
    for _ in range(4):
        _, headers, _ = await h.post(gateway.url, "/v1/chat/completions", h.chat())
        workers[headers["x-kvsidecar-worker"]] += 1
    assert sorted(workers.values()) == [2, 2]
