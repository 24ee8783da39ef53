"""The test gate on one streamed reply (``tests.support.stream_gate``), in front of a real
aiohttp server that writes its whole SSE stream at once: the gated client gets exactly the
gate's events and then a cut connection; every other request passes whole."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import BaseTestServer, TestServer

from tests.support.stream_gate import StreamGate

EVENTS = 10


async def _stream(request: web.Request) -> web.StreamResponse:
    """Ten events, each an id comment and a data line (as a sidecar writes them), some
    events split across writes, then [DONE]: all written before anyone reads."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    body = b"".join(b": kvs-ids %d\ndata: {\"n\": %d}\n\n" % (i, i) for i in range(EVENTS))
    for piece in (body[:7], body[7:100], body[100:]):
        await response.write(piece)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


@pytest.fixture
async def server() -> AsyncIterator[BaseTestServer]:
    app = web.Application()
    app.router.add_get("/stream", _stream)
    async with TestServer(app) as srv:
        yield srv


async def _events(resp: aiohttp.ClientResponse) -> list[bytes]:
    return [line.strip() async for line in resp.content if line.startswith(b"data:")]


async def test_the_gated_reply_stops_at_its_event_and_is_cut(server: BaseTestServer) -> None:
    """The marked request's client reads the first 4 data events, then its connection ends
    without the rest; a later request with the same marker passes whole."""
    with StreamGate(str(server.make_url("")), b"x-cut: yes", events=4) as gate:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{gate.url}/stream", headers={"x-cut": "yes"}) as resp:
                await asyncio.to_thread(gate.wait_holding)
                assert gate.events_passed == 4
                gate.cut()
                lines: list[bytes] = []
                with pytest.raises(aiohttp.ClientPayloadError):
                    while line := await resp.content.readline():
                        lines.append(line)
                read = [line.strip() for line in lines if line.startswith(b"data:")]
                assert read == [b'data: {"n": %d}' % i for i in range(4)]
            async with session.get(f"{gate.url}/stream", headers={"x-cut": "yes"}) as resp:
                assert len(await _events(resp)) == EVENTS + 1  # [DONE] too


async def test_unmarked_requests_pass_whole(server: BaseTestServer) -> None:
    """A request without the marker is relayed byte for byte, and the gate holds nothing."""
    with StreamGate(str(server.make_url("")), b"x-cut: yes", events=4) as gate:
        async with aiohttp.ClientSession() as session, \
                session.get(f"{gate.url}/stream") as resp:
            assert (await _events(resp))[-1] == b"data: [DONE]"
        with pytest.raises(RuntimeError, match="wait_holding"):
            gate.cut()


async def test_a_reply_that_ends_first_fails_the_wait(server: BaseTestServer) -> None:
    """A gated reply that ends before the gate's event: the wait fails saying how far it got."""
    with StreamGate(str(server.make_url("")), b"x-cut: yes", events=EVENTS + 5) as gate:
        async with aiohttp.ClientSession() as session, \
                session.get(f"{gate.url}/stream", headers={"x-cut": "yes"}) as resp:
            with pytest.raises(AssertionError, match=f"after {EVENTS + 1} SSE data events"):
                await asyncio.to_thread(gate.wait_holding)
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
