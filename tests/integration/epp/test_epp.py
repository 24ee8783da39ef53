"""``kvsidecar epp`` driven as Envoy drives it: real engines, sidecars and the picker on
ephemeral ports, a gRPC client built from Envoy's own ext_proc messages."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvsidecar.launch import ManagedProcess
from routing.epp.stream import BODY_PIECE_BYTES
from tests.integration.epp.conftest import MODEL, Fleet, start_epp, workers
from tests.integration.epp.envoy import BUFFERED, STREAMED, EnvoyStream, forward
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
# A long shared prefix: many KV blocks of 16 tokens, so its overlap outweighs a request's load.
SYSTEM = " ".join(f"rule {i}: answer briefly and cite the section {i * 7}." for i in range(40))


def chat(question: str, stream: bool = False) -> bytes:
    return json.dumps({
        "model": "tiny",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 4,
        "stream": stream,
    }).encode()


def worker_of(fleet: Fleet, endpoint: str) -> str:
    assert endpoint in fleet.engines, (endpoint, fleet.engines)
    return f"w{fleet.engines.index(endpoint)}"


async def routable(session: aiohttp.ClientSession, fleet: Fleet) -> None:
    async def both() -> bool:
        ws = await workers(session, fleet.epp_url)
        return len(ws) == 2 and all(w["routable"] for w in ws.values())

    await eventually(both, "both workers routable at the picker", 60)


async def test_health_services_serve(fleet: Fleet, channel: grpc.aio.Channel) -> None:
    """liveness, readiness, the ext_proc service and the overall service are SERVING."""
    stub = health_pb2_grpc.HealthStub(channel)
    services = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")

    async def serving() -> bool:
        for service in services:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, (service, reply)
        return True

    await eventually(serving, "every health service SERVING (workers discovered)")


async def test_pick_follows_the_cached_prefix(
    fleet: Fleet, channel: grpc.aio.Channel, session: aiohttp.ClientSession
) -> None:
    """The pick is an engine's ip:port in header and metadata alike; the request runs there,
    its load counts until the response ends, and once its blocks are in the index a request
    with the same prefix goes to that engine even while it is the busier one."""
    await routable(session, fleet)
    listed = {w["engine_url"] for w in (await workers(session, fleet.epp_url)).values()}
    assert listed == {f"http://{e}" for e in fleet.engines}  # from the sidecars' /v1/workers
    first = EnvoyStream(channel)
    picked = await first.request(CHAT, chat("What is rule 3?"), "req-1")
    holder = worker_of(fleet, picked.endpoint)
    assert picked.body == chat("What is rule 3?")  # sent back whole, unchanged
    assert picked.headers["content-length"] == str(len(picked.body))
    assert (await workers(session, fleet.epp_url))[holder]["in_flight"] == 1
    status, body = await forward(session, first, CHAT, picked)
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"] is not None
    await first.close()

    async def released_and_cached() -> bool:
        w = (await workers(session, fleet.epp_url))[holder]
        assert w["in_flight"] == 0, w
        return bool(w["cached_blocks"]["gpu"] >= 20)

    await eventually(released_and_cached, "the first prompt's blocks in the picker's index")

    # Make the holder the busier worker: a request held in flight there (the subset hint
    # confines it to the holder), so only the cached prefix can still draw the next one.
    busy = EnvoyStream(channel, subset=[picked.endpoint])
    held = await busy.request(CHAT, json.dumps({"model": "tiny", "messages": [
        {"role": "user", "content": "something else entirely"}]}).encode(), "req-busy")
    assert held.endpoint == picked.endpoint
    second = EnvoyStream(channel)
    again = await second.request(CHAT, chat("And rule 9?", stream=True), "req-2")
    assert again.endpoint == picked.endpoint
    status, body = await forward(session, second, CHAT, again)
    assert status == 200
    assert body.rstrip().endswith(b"data: [DONE]")  # the stream relayed whole through the picker
    await second.close()
    busy.cancel()  # Envoy's stream reset (the client went away): its load is released too

    async def idle() -> bool:
        return all(w["in_flight"] == 0 for w in (await workers(session, fleet.epp_url)).values())

    await eventually(idle, "every pick released")


async def test_buffered_mode_and_bodiless_requests(
    fleet: Fleet, channel: grpc.aio.Channel, session: aiohttp.ClientSession
) -> None:
    """In BUFFERED mode the headers are answered at once and the pick rides on the body's
    answer; a request without a body is picked from its headers; an Envoy that does not say
    its mode (no protocol_config) gets the --body-mode default, full duplex."""
    await routable(session, fleet)
    unsaid = EnvoyStream(channel, send_protocol_config=False)
    picked = await unsaid.request(CHAT, chat("What is rule 4?"), "req-unsaid")
    worker_of(fleet, picked.endpoint)
    unsaid.cancel()
    stream = EnvoyStream(channel, body_mode=BUFFERED)
    picked = await stream.request(CHAT, chat("What is rule 5?"), "req-buffered")
    worker_of(fleet, picked.endpoint)
    status, _ = await forward(session, stream, CHAT, picked)
    assert status == 200
    await stream.close()
    get = EnvoyStream(channel)
    bodiless = await get.request("/v1/models", None, "req-get", method="GET")
    worker_of(fleet, bodiless.endpoint)
    await get.response(200, "application/json", [b"{}"])
    await get.close()


async def test_the_edges_envoy_and_gie_bring(
    fleet: Fleet, channel: grpc.aio.Channel, session: aiohttp.ClientSession
) -> None:
    """What GIE's reference picker does and Envoy expects: a subset hint given as one
    comma-separated string (as header-to-metadata filters write it) confines the pick; a
    150 KB body goes back in pieces of at most 62,000 bytes; every answer carrying a pick
    clears Envoy's route cache; and in STREAMED body mode the pick comes on the headers'
    answer (by load), since Envoy ignores a header mutation on a streamed chunk's answer."""
    await routable(session, fleet)
    first, second = fleet.engines
    for hint in (f" {second} ", f"10.255.255.1:8000,{second}", [f"10.255.255.1:8000, {second}"]):
        stream = EnvoyStream(channel, subset=hint)
        picked = await stream.request(CHAT, chat("What is rule 6?"), "req-subset-text")
        assert picked.endpoint == second, hint
        assert picked.clear_route_cache
        stream.cancel()
    stream = EnvoyStream(channel, subset=f"10.255.255.1:8000,{first}")
    assert (await stream.request(CHAT, chat("rule 7?"), "req-subset-first")).endpoint == first
    stream.cancel()

    large = json.dumps({"model": "tiny", "max_tokens": 1, "user": "u" * 150_000, "messages": [
        {"role": "user", "content": "hi"}]}).encode()  # the bulk in a field not tokenized
    assert len(large) > 150_000
    stream = EnvoyStream(channel)
    picked = await stream.request(CHAT, large, "req-large", chunks=5)
    assert picked.body == large and picked.clear_route_cache
    assert len(picked.pieces) == -(-len(large) // BODY_PIECE_BYTES)
    assert max(picked.pieces) <= BODY_PIECE_BYTES < 64 * 1024
    stream.cancel()

    for mode in (BUFFERED, STREAMED):
        stream = EnvoyStream(channel, body_mode=mode)
        picked = await stream.request(CHAT, chat("What is rule 8?"), f"req-{mode}")
        worker_of(fleet, picked.endpoint)
        assert picked.clear_route_cache, mode
        status, body = await forward(session, stream, CHAT, picked)
        assert status == 200, body
        await stream.close()
    async with session.get(f"{fleet.epp_url}/metrics") as resp:
        text = await resp.text()
    assert 'kvsidecar_epp_picks_total{outcome="streamed_by_load"} 1.0' in text

    async def idle() -> bool:
        return all(w["in_flight"] == 0 for w in (await workers(session, fleet.epp_url)).values())

    await eventually(idle, "every pick released")


async def test_refusals_are_immediate_responses(
    fleet: Fleet, channel: grpc.aio.Channel, session: aiohttp.ClientSession
) -> None:
    """A body that is not JSON gets 400, an unknown model 404, a subset hint naming no
    endpoint of the pool 503: each an OpenAI-shaped immediate response, nothing in flight."""
    await routable(session, fleet)
    cases = [
        (None, b'{"model": "tiny", "messages": [', 400),
        (None, json.dumps({"model": "nope", "messages": [
            {"role": "user", "content": "hi"}]}).encode(), 404),
        (["10.255.255.1:8000"], chat("hi"), 503),
    ]
    for subset, body, expected in cases:
        stream = EnvoyStream(channel, subset=subset)
        refused = await stream.request(CHAT, body, f"req-{expected}")
        assert refused.immediate is not None, expected
        assert refused.immediate.status.code == expected
        error = json.loads(refused.immediate.body)["error"]
        assert error["message"] and error["type"], error
        headers = {o.header.key: o.header.raw_value for o in
                   refused.immediate.headers.set_headers}
        assert headers["content-type"] == b"application/json"
        await stream.close()
    assert all(w["in_flight"] == 0 for w in (await workers(session, fleet.epp_url)).values())
    async with session.get(f"{fleet.epp_url}/metrics") as resp:
        text = await resp.text()
    assert 'kvsidecar_epp_picks_total{outcome="400"}' in text
    assert 'kvsidecar_epp_picks_total{outcome="503"}' in text


async def test_no_ready_endpoint_is_503(tmp_path: Path) -> None:
    """A picker whose sidecar is not there is alive but not ready, and answers 503."""
    procs: list[ManagedProcess] = []
    try:
        url, target = start_epp(procs, tmp_path, "epp-alone", [
            "--model-path", str(MODEL), "--sidecar", "http://127.0.0.1:9"])
        async with grpc.aio.insecure_channel(target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            codes = health_pb2.HealthCheckResponse
            live = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"))
            ready = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
            assert (live.status, ready.status) == (codes.SERVING, codes.NOT_SERVING)
            stream = EnvoyStream(ch)
            refused = await stream.request(CHAT, chat("hi"), "req-none")
            assert refused.immediate is not None
            assert refused.immediate.status.code == 503
            await stream.close()
        async with aiohttp.ClientSession() as s, s.post(f"{url}{CHAT}", data=b"{}") as resp:
            assert resp.status == 404  # the picker proxies nothing
    finally:
        for proc in procs:
            proc.stop()

