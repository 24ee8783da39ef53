"""Goodput end to end: each served request is judged against its TTFT and ITL targets, the
gateway's or those its headers name, and counted on /metrics; a bad target is a 400."""

from __future__ import annotations

import re

import orjson

from tests.support import gateway_http as h


async def _goodput(url: str) -> dict[str, float]:
    _, text = await h.get(url, "/metrics")
    return {m.group(1).decode(): float(m.group(2)) for m in re.finditer(
        rb'^kvsidecar_gateway_goodput_requests_total\{outcome="(\w+)"\} (\S+)$', text,
        re.MULTILINE)}


async def test_each_request_is_judged_against_its_targets(spawn) -> None:  # type: ignore[no-untyped-def]
    engine = spawn.engine()
    gateway = spawn.gateway([engine], "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000")
    stream = h.chat(stream=True, max_tokens=4, fake_delay_s=0.02)
    assert (await h.post(gateway.url, "/v1/chat/completions", stream))[0] == 200
    assert await _goodput(gateway.url) == {"met": 1}
    # The engine's 20 ms between tokens misses a 1 ms ITL target; 60 s of TTFT is met.
    status, _, _ = await h.post(gateway.url, "/v1/chat/completions", stream,
                                {"x-kvsidecar-slo-itl-ms": "1"})
    assert status == 200
    # A TTFT target of 1 µs is missed by any reply; a reply not streamed has no ITL.
    status, _, _ = await h.post(gateway.url, "/v1/chat/completions", h.chat(max_tokens=4),
                                {"x-kvsidecar-slo-ttft-ms": "0.001"})
    assert status == 200
    assert await _goodput(gateway.url) == {"met": 1, "missed_itl": 1, "missed_ttft": 1}


async def test_a_bad_target_is_refused_and_names_its_header(spawn) -> None:  # type: ignore[no-untyped-def]
    engine = spawn.engine()
    gateway = spawn.gateway([engine])
    status, _, body = await h.post(gateway.url, "/v1/chat/completions", h.chat(),
                                   {"x-kvsidecar-slo-ttft-ms": "soon"})
    error = orjson.loads(body)["error"]
    assert status == 400 and error["param"] == "x-kvsidecar-slo-ttft-ms", error
    assert await _goodput(gateway.url) == {}
