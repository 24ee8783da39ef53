"""Request migration: a stream whose worker dies goes on on another, and reads as one stream.

Real processes: two torch reference engines (greedy output is a function of the tokens so far,
so a continuation elsewhere must produce what an uninterrupted run does), a sidecar each, one
gateway with ``--migration-limit``. The serving engine is killed mid-stream (SIGKILL, as a
crash); the client's stream must go on without a visible break. The engines are the
module's: one a test killed is started again on its ports before the next.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from kvsidecar.local_stack import LocalStack
from tests.integration.disagg.pd_stack import complete, gateway, metric, pd_stack, routable
from tests.support.polling import eventually
from tests.support.stacks import own_gateways

WORDS = ["cache", "token", "prefix", "block", "engine", "gateway", "replica", "memory"]
MAX_TOKENS = 400


def _prompt(seed: int, words: int = 40) -> str:
    return " ".join(WORDS[(seed * 3 + i * 5) % len(WORDS)] + str((seed + i) % 97)
                    for i in range(words))


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """The two torch engines and their sidecars, shared by the module's tests."""
    stack = pd_stack(tmp_path_factory.mktemp("migration"), ["agg", "agg"], compute="torch")
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def stack(engines: LocalStack) -> Iterator[LocalStack]:
    """The shared engines, each one an earlier test killed started again on its ports (its
    cache empty); the gateways the test starts are stopped after it."""
    for worker_id in engines.engine_urls:
        proc = engines.process(worker_id)
        if proc.proc.poll() is not None:
            engines.restart(proc)
    with own_gateways(engines):
        yield engines


async def _stream_and_kill(
    session: aiohttp.ClientSession, stack: LocalStack, url: str, text: str, chat: bool,
    kill_after: int,
) -> tuple[str, dict[str, Any]]:
    """Stream ``text``; after ``kill_after`` events, SIGKILL the engine serving it. Returns
    (the worker first serving it, the stream folded as ``complete`` folds it)."""
    body: dict[str, Any] = {"model": "tiny", "max_tokens": MAX_TOKENS, "stream": True,
                            "temperature": 0, "ignore_eos": True,
                            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = text
        path = "/v1/completions"
    chunks: list[dict[str, Any]] = []
    raw_lines: list[bytes] = []
    async with session.post(url + path, json=body) as resp:
        assert resp.status == 200
        worker = resp.headers["x-kvsidecar-worker"]
        async for line in resp.content:
            raw_lines.append(line)
            if not line.startswith(b"data:"):
                continue
            if line.strip() == b"data: [DONE]":
                break
            chunks.append(json.loads(line[5:]))
            if len(chunks) == kill_after:
                stack.process(worker).kill()
    assert not any(line.startswith(b":") for line in raw_lines), "token-id comments leaked"
    text_out, finish, usage = "", None, None
    roles = 0
    for c in chunks:
        for choice in c.get("choices", ()):
            delta = choice.get("delta") or {}
            roles += "role" in delta
            piece = choice.get("text") if "text" in choice else delta.get("content")
            text_out += piece or ""
            finish = choice.get("finish_reason") or finish
        usage = c.get("usage") or usage
    return worker, {"text": text_out, "finish_reason": finish, "usage": usage,
                    "ids": {c["id"] for c in chunks}, "roles": roles,
                    "created": {c["created"] for c in chunks}}


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True])
async def test_stream_survives_its_engine_dying(stack, session, chat) -> None:  # type: ignore[no-untyped-def]
    """Greedy output through a migration equals an uninterrupted run, as one stream."""
    url = gateway(stack, "gateway", "--migration-limit", "2", "--upstream-timeout-s", "20")
    await routable(session, url, 2)
    text = _prompt(7 if chat else 3)
    status, _, whole = await complete(session, url, text, MAX_TOKENS, stream=True, chat=chat)
    assert status == 200 and whole["usage"]["completion_tokens"] == MAX_TOKENS

    first, migrated = await _stream_and_kill(session, stack, url, text, chat, kill_after=20)

    assert migrated["text"] == whole["text"]
    assert migrated["finish_reason"] == whole["finish_reason"] == "length"
    usage = migrated["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert len(migrated["ids"]) == 1 and len(migrated["created"]) == 1  # one stream's chunks
    if chat:
        assert migrated["roles"] == 1
    assert await metric(session, url, "kvsidecar_gateway_migrations_total") == 1
    assert await metric(session, url, "kvsidecar_gateway_streams_lost_total") == 0
    # The survivor serves what comes next; the dead worker leaves placement.
    survivor = next(w for w in stack.sidecar_urls if w != first)
    status, worker, _ = await complete(session, url, _prompt(11), 4)
    assert (status, worker) == (200, survivor)


@pytest.mark.slow
async def test_without_migration_the_stream_is_cut(stack, session) -> None:  # type: ignore[no-untyped-def]
    """--migration-limit 0 (the default): the client sees its stream end without [DONE]."""
    url = gateway(stack, "gateway")
    await routable(session, url, 2)
    with pytest.raises(aiohttp.ClientPayloadError):
        await _stream_and_kill(session, stack, url, _prompt(5), False, kill_after=10)

    async def counted() -> bool:
        return await metric(session, url, "kvsidecar_gateway_streams_lost_total") == 1

    await eventually(counted, "the cut stream counted as lost", timeout_s=10)


@pytest.mark.slow
async def test_past_the_limit_the_stream_is_cut(stack, session) -> None:  # type: ignore[no-untyped-def]
    """--migration-limit 1: the first death migrates, the second cuts the stream."""
    url = gateway(stack, "gateway", "--migration-limit", "1")
    await routable(session, url, 2)
    body = {"model": "tiny", "prompt": _prompt(9), "max_tokens": MAX_TOKENS, "stream": True,
            "temperature": 0, "ignore_eos": True}
    events = 0
    killed: list[str] = []
    with pytest.raises(aiohttp.ClientPayloadError):
        async with session.post(url + "/v1/completions", json=body) as resp:
            killed.append(resp.headers["x-kvsidecar-worker"])
            async for line in resp.content:
                events += line.startswith(b"data:")
                if events == 10:
                    stack.process(killed[0]).kill()
                elif events == 30:  # on the second worker now
                    killed.append(next(w for w in stack.sidecar_urls if w != killed[0]))
                    stack.process(killed[1]).kill()
    assert events >= 30
    assert await metric(session, url, "kvsidecar_gateway_migrations_total") == 1
    assert await metric(session, url, "kvsidecar_gateway_streams_lost_total") == 1
