"""Prefill/decode disaggregation end to end: real engines, sidecars and gateways."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsidecar.local_stack import EngineSpec, LocalStack
from tests.integration.disagg.pd_stack import (
    answer_text,
    capacity_known,
    complete,
    gateway,
    metric,
    metric_reaches,
    pd_stack,
    routable,
)

WORDS = ["cache", "token", "prefix", "block", "engine", "gateway", "replica", "memory"]


def prompt(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 5 + i * 3) % len(WORDS)] + str((seed + i) % 89)
                    for i in range(words))



@pytest.fixture
def torch_stack(tmp_path: Path) -> Iterator[tuple[LocalStack, str, str]]:
    """agg + prefill + decode torch engines; a PD gateway and an aggregated-only gateway."""
    stack = pd_stack(tmp_path, ["agg", "prefill", "decode"], compute="torch")
    try:
        pd = gateway(stack, "gateway-pd")
        agg = gateway(stack, "gateway-agg", "--pd-mode", "off")
        yield stack, pd, agg
    finally:
        stack.stop()


@pytest.mark.slow
async def test_greedy_output_matches_aggregated_serving(torch_stack, session) -> None:  # type: ignore[no-untyped-def]
    """Greedy answers through a prefill/decode pair equal aggregated ones, token for token."""
    _, pd, agg = torch_stack
    await routable(session, pd, 3)
    await routable(session, agg, 3)
    cases = [(prompt(1, 60), False, False), (prompt(2, 45), True, False),
             (prompt(3, 30), False, True), (prompt(4, 70), True, True)]
    for text, stream, chat in cases:
        s1, w1, b1 = await complete(session, agg, text, 12, stream=stream, chat=chat)
        s2, w2, b2 = await complete(session, pd, text, 12, stream=stream, chat=chat)
        assert (s1, w1) == (200, "agg-0")
        assert (s2, w2) == (200, "prefill-1,decode-2")
        if stream:
            assert b2["text"] == b1["text"] and b2["finish_reason"] == b1["finish_reason"]
            assert b2["usage"]["completion_tokens"] == b1["usage"]["completion_tokens"] == 12
            assert b2["chunks"] == b1["chunks"]  # one continuous stream, first token included
        else:
            assert answer_text(b2) == answer_text(b1)
            assert b2["usage"]["prompt_tokens"] == b1["usage"]["prompt_tokens"]
            assert b2["usage"]["completion_tokens"] == b1["usage"]["completion_tokens"] == 12
    assert await metric(session, pd, "kvsidecar_gateway_pd_completed_total") == len(cases)
    # A one-token answer is the prefill's alone: no decode leg, same token.
    s1, _, b1 = await complete(session, agg, prompt(5, 40), 1)
    s2, _, b2 = await complete(session, pd, prompt(5, 40), 1)
    assert s1 == s2 == 200 and answer_text(b1) == answer_text(b2)


@pytest.fixture
def broken_stack(tmp_path: Path) -> Iterator[LocalStack]:
    """The decode engine looks for pages in another store than the prefill engine writes."""
    stack = pd_stack(tmp_path, ["agg", EngineSpec(role="prefill", page_store="pages-prefill"),
                                EngineSpec(role="decode", page_store="pages-decode")])
    try:
        yield stack
    finally:
        stack.stop()


@pytest.mark.slow
async def test_failed_transfer_under_each_policy(broken_stack, session) -> None:  # type: ignore[no-untyped-def]
    """fail: 502 kv_transfer_failed (or an error event mid-stream); fallback: re-run on the
    agg worker; both counted."""
    stack = broken_stack
    fail = gateway(stack, "gateway-fail", "--kv-load-failure-policy", "fail")
    fallback = gateway(stack, "gateway-fallback", "--kv-load-failure-policy", "fallback")
    alone = gateway(stack, "gateway-alone", "--kv-load-failure-policy", "fallback",
                    workers=["prefill-1", "decode-2"])
    for url, count in ((fail, 3), (fallback, 3), (alone, 2)):
        await routable(session, url, count)
    text = prompt(7, 50)
    status, _, body = await complete(session, fail, text, 8)
    assert status == 502
    assert body["error"]["code"] == "kv_transfer_failed"
    assert "KV transfer failed" in body["error"]["message"]
    assert "imported" in body["error"]["message"]  # the engine's own reason comes along
    # Without a fallback the first token streams at once; the failure ends the stream.
    status, worker, body = await complete(session, fail, text, 8, stream=True)
    assert (status, worker) == (200, "prefill-1,decode-2")
    assert body["text"] and body["finish_reason"] is None
    assert body["error"]["code"] == "kv_transfer_failed"
    status, worker, body = await complete(session, fallback, text, 8, stream=True)
    assert (status, worker) == (200, "agg-0")
    assert body["usage"]["completion_tokens"] == 8
    status, _, body = await complete(session, alone, text, 8)
    assert status == 503 and "no aggregated worker" in body["error"]["message"]
    name = 'kvsidecar_gateway_kv_transfer_failures_total{policy="%s"}'
    assert await metric(session, fail, name % "fail") == 2
    assert await metric(session, fallback, name % "fallback") == 1
    rerun = 'kvsidecar_gateway_pd_fallbacks_total{outcome="%s"}'
    assert await metric(session, fallback, rerun % "rerun") == 1
    assert await metric(session, alone, rerun % "no_worker") == 1


@pytest.mark.slow
async def test_handoff_timeout_counts_as_failed_transfer(tmp_path, session) -> None:  # type: ignore[no-untyped-def]
    """A handoff slower than --kv-transfer-timeout-s fails cleanly with the fail policy."""
    stack = pd_stack(tmp_path, ["prefill", "decode"], speedup=0.05)
    try:
        url = gateway(stack, "gateway", "--kv-load-failure-policy", "fail",
                                  "--kv-transfer-timeout-s", "0.01")
        await routable(session, url, 2)
        status, _, body = await complete(session, url, prompt(9, 40), 4)
        assert status == 502 and body["error"]["code"] == "kv_transfer_failed"
        assert "did not complete within 0.01s" in body["error"]["message"]
    finally:
        stack.stop()


@pytest.fixture
def small_decode_stack(tmp_path: Path) -> Iterator[LocalStack]:
    """A decode engine whose KV pool holds 16 blocks of 16 tokens."""
    stack = pd_stack(tmp_path, ["prefill",
                                EngineSpec(role="decode", args=("--max-total-tokens", "256"))],
                     speedup=1)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.mark.slow
async def test_full_decode_pool_applies_backpressure(small_decode_stack, session) -> None:  # type: ignore[no-untyped-def]
    """With the decode pool full a request waits for room (or gets 503); none is lost.

    The decode engine is stopped while the requests arrive, so the one placed first holds
    its room until every other has met the full pool, however fast the machine."""
    stack = small_decode_stack
    waits = gateway(stack, "gateway-wait", "--pd-queue-timeout-s", "30")
    rejects = gateway(stack, "gateway-reject", "--pd-queue-timeout-s", "0")
    for url in (waits, rejects):
        await routable(session, url, 2)
        await capacity_known(session, url, "decode-1", 16)  # till then: room for anything
    # Each needs ceil((~100 prompt + 60 output) / 16) = 10+ blocks: two never fit together.
    async with asyncio.TaskGroup() as tg:
        with stack.process("decode-1").paused():
            tasks = [tg.create_task(complete(session, waits, prompt(20 + i, 45), 60,
                                             stream=True)) for i in range(3)]
            await metric_reaches(session, waits, "kvsidecar_gateway_pd_waiting", 2)
    results = [t.result() for t in tasks]
    assert [r[0] for r in results] == [200, 200, 200]
    assert all(r[2]["usage"]["completion_tokens"] == 60 for r in results)
    assert await metric(session, waits, "kvsidecar_gateway_pd_backpressure_waits_total") == 2
    assert await metric(session, waits, "kvsidecar_gateway_pd_waiting") == 0
    async with asyncio.TaskGroup() as tg:
        with stack.process("decode-1").paused():
            tasks = [tg.create_task(complete(session, rejects, prompt(30 + i, 45), 60))
                     for i in range(2)]
            await metric_reaches(session, rejects,
                                 "kvsidecar_gateway_pd_backpressure_rejects_total", 1)
    results = [t.result() for t in tasks]
    statuses = sorted(r[0] for r in results)
    assert statuses == [200, 503]
    rejected = next(r for r in results if r[0] == 503)
    assert "every decode worker is full" in rejected[2]["error"]["message"]
    assert await metric(session, rejects, "kvsidecar_gateway_pd_backpressure_rejects_total") == 1
    # A request that can never fit is told so at once.
    status, _, body = await complete(session, rejects, prompt(40, 200), 100)
    assert status == 503 and "no decode worker has that many" in body["error"]["message"]
