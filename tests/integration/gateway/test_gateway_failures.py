"""Failure handling end to end: dead workers, saturation, client disconnects, many streams."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import orjson
import pytest

from tests.support import gateway_http as h
from tests.support.polling import eventually
from tests.support.processes import log_event

pytestmark = pytest.mark.slow  # real processes, seconds a test

NO_PROBES = ("--health-check-interval-s", "3600")


async def test_retry_on_worker_that_refuses_connections(spawn) -> None:  # type: ignore[no-untyped-def]
    """Requests placed on a dead worker are retried on the live one; none fails."""
    dead, alive = spawn.engine(), spawn.engine()
    gateway = spawn.gateway([dead, alive], "--router-mode", "round-robin", *NO_PROBES)
    for _ in range(4):  # warm pooled keep-alive connections to both
        assert (await h.post(gateway.url, "/v1/chat/completions", h.chat()))[0] == 200
    dead.stop()
    served = Counter()
    for _ in range(6):
        status, headers, _ = await h.post(gateway.url, "/v1/chat/completions", h.chat())
        assert status == 200
        served[headers["x-kvsidecar-worker"]] += 1
    assert served == {alive.url: 6}
    workers = {w["worker_id"]: w for w in (await h.get_json(gateway.url, "/v1/workers"))["workers"]}
    assert not workers[dead.url]["healthy"] and workers[alive.url]["healthy"]
    assert all(w["in_flight"] == 0 for w in workers.values())
    _, metrics = await h.get(gateway.url, "/metrics")
    assert b"kvsidecar_gateway_retries_total 1.0" in metrics


async def test_503_when_no_worker_is_healthy(spawn) -> None:  # type: ignore[no-untyped-def]
    """With every worker down the gateway answers 503, OpenAI-shaped, and /health is 503."""
    engine = spawn.engine()
    url = engine.url
    engine.stop()
    gateway = spawn.gateway(
        [url], "--router-mode", "round-robin", "--served-model-name", "fake-model", *NO_PROBES
    )
    status, headers, body = await h.post(gateway.url, "/v1/chat/completions", h.chat())
    assert status == 503 and "no healthy worker" in orjson.loads(body)["error"]["message"]
    assert "x-request-id" in headers
    assert (await h.get(gateway.url, "/health"))[0] == 503


async def test_worker_dying_mid_request_is_502_after_retries(spawn) -> None:  # type: ignore[no-untyped-def]
    """When the only worker dies, a request fails with 502 instead of hanging."""
    engine = spawn.engine()
    gateway = spawn.gateway([engine], "--router-mode", "round-robin", *NO_PROBES)
    assert (await h.post(gateway.url, "/v1/chat/completions", h.chat()))[0] == 200
    engine.stop()
    status, _, body = await h.post(gateway.url, "/v1/chat/completions", h.chat())
    assert status == 502 and "failed" in orjson.loads(body)["error"]["message"]


async def _open_stream(port: int, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:  # type: ignore[type-arg]
    raw = orjson.dumps(body)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
        b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(raw), raw)
    )
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"data: ")  # the head and the start of the first event
    assert head.startswith(b"HTTP/1.1 200")
    return reader, writer


async def test_client_disconnect_aborts_upstream(spawn) -> None:  # type: ignore[no-untyped-def]
    """Closing the client mid-stream closes the engine's request; other streams go on."""
    engine = spawn.engine()
    gateway = spawn.gateway([engine], "--router-mode", "round-robin")
    _, writer = await _open_stream(
        gateway.port, h.chat(stream=True, fake_tokens=50, fake_hang=True)
    )
    other = asyncio.ensure_future(
        h.post(
            gateway.url,
            "/v1/chat/completions",
            h.chat(stream=True, max_tokens=20, fake_delay_s=0.01),
        )
    )
    stats = await h.get_json(engine.url, "/_stats")
    assert stats["aborted"] == 0
    writer.close()

    async def aborted() -> bool:
        return (await h.get_json(engine.url, "/_stats"))["aborted"] == 1

    await eventually(aborted, "the worker to see the abort", 10.0)
    status, _, body = await other
    assert status == 200 and h.sse_events(body)[-1] == b"[DONE]"

    async def drained() -> bool:
        workers = (await h.get_json(gateway.url, "/v1/workers"))["workers"]
        return workers[0]["in_flight"] == 0

    await eventually(drained, "the gateway to drain", 10.0)
    _, metrics = await h.get(gateway.url, "/metrics")
    assert b"kvsidecar_gateway_client_aborts_total 1.0" in metrics


async def test_429_when_every_worker_is_saturated(spawn) -> None:  # type: ignore[no-untyped-def]
    """With every worker at --max-in-flight-per-worker, a new request gets 429."""
    engines = [spawn.engine(), spawn.engine()]
    gateway = spawn.gateway(
        engines, "--router-mode", "least-loaded", "--max-in-flight-per-worker", "1"
    )
    held = [await _open_stream(gateway.port, h.chat(stream=True, fake_hang=True)) for _ in range(2)]
    workers = (await h.get_json(gateway.url, "/v1/workers"))["workers"]
    assert [w["in_flight"] for w in workers] == [1, 1]
    status, headers, body = await h.post(gateway.url, "/v1/chat/completions", h.chat())
    error = orjson.loads(body)["error"]
    assert status == 429 and error["code"] == "rate_limit_exceeded"
    assert error["type"] == "rate_limit_error" and headers["retry-after"] == "1"
    assert "x-request-id" in headers
    for _, writer in held:
        writer.close()

    async def free() -> bool:
        ws = (await h.get_json(gateway.url, "/v1/workers"))["workers"]
        return all(w["in_flight"] == 0 for w in ws)

    await eventually(free, "the worker to be free", 10.0)
    assert (await h.post(gateway.url, "/v1/chat/completions", h.chat()))[0] == 200


async def test_sigterm_drains_in_flight_streams(spawn) -> None:  # type: ignore[no-untyped-def]
    """On SIGTERM the gateway stops listening but lets a running stream finish, then exits 0."""
    engine = spawn.engine()
    gateway = spawn.gateway([engine], "--router-mode", "round-robin", *NO_PROBES, process=True)
    assert (await h.post(gateway.url, "/v1/chat/completions", h.chat()))[0] == 200
    # The engine takes nothing on until the signal has landed: the stream is in flight then,
    # however fast it would have run, and all of it is served while the gateway drains.
    with engine.paused():
        stream = asyncio.ensure_future(
            h.post(
                gateway.url,
                "/v1/chat/completions",
                h.chat(stream=True, max_tokens=20, fake_delay_s=0.02),
            )
        )

        async def in_flight() -> bool:
            workers = (await h.get_json(gateway.url, "/v1/workers"))["workers"]
            return workers[0]["in_flight"] == 1

        await eventually(in_flight, "the stream to be in flight", 10.0)
        gateway.popen.terminate()
        stopping = await eventually(
            lambda: log_event(gateway.log, "gateway_stopping", gateway.popen),
            "the gateway to take the signal", 10.0)
        assert stopping["in_flight"] == 1
    status, _, body = await stream
    assert status == 200 and len(h.sse_events(body)) == 21
    assert await asyncio.to_thread(gateway.popen.wait, 10) == 0
    assert '"gateway_stopped"' in gateway.log_text()


async def test_200_concurrent_streams_complete(spawn) -> None:  # type: ignore[no-untyped-def]
    """200 concurrent streams through the gateway all finish with every event in order."""
    engines = [spawn.engine(), spawn.engine()]
    gateway = spawn.gateway(engines, "--router-mode", "least-loaded")
    tokens = 8
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(i: int) -> tuple[int, bytes]:
            body = h.chat(f"stream {i}", stream=True, max_tokens=tokens, fake_delay_s=0.005)
            async with session.post(
                gateway.url + "/v1/chat/completions",
                data=orjson.dumps(body),
                headers={"x-request-id": f"s{i}"},
            ) as r:
                return r.status, await r.read()

        results = await asyncio.gather(*(one(i) for i in range(200)))
    for status, raw in results:
        events = h.sse_events(raw)
        assert status == 200 and events[-1] == b"[DONE]" and len(events) == tokens + 1
        assert [orjson.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]] == [
            f"t{i} " for i in range(tokens)
        ]
    stats = [await h.get_json(e.url, "/_stats") for e in engines]
    assert sum(s["streams"] for s in stats) == 200
    assert all(s["aborted"] == 0 for s in stats)
    assert min(s["streams"] for s in stats) >= 50  # least-loaded spread them
