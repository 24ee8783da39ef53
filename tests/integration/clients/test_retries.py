"""Clients that retry as documented are served once capacity returns: the gateway's 503 (no
worker) and 429 (every worker busy) carry ``retry-after``, which the openai SDK's built-in
retries honour. Each refusal is held in the client's response hook until the test has
brought capacity back, so the retry that follows is served: no race is left to chance."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.integration.clients.conftest import MODEL_NAME, Stack
from tests.support.gateway import routable
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "say something about caches"}]


class HeldRefusals:
    """The client's response hook: records each answer; a refusal with ``status`` is held
    until ``restore`` (the test's way of bringing capacity back) has run."""

    def __init__(self, status: int, restore: Callable[[], Awaitable[None]]) -> None:
        self.status = status
        self.restore = restore
        self.answers: list[tuple[int, str | None]] = []

    async def __call__(self, response: httpx.Response) -> None:
        self.answers.append((response.status_code, response.headers.get("retry-after")))
        if response.status_code == self.status:
            await response.aread()
            await self.restore()

    def client(self, url: str) -> openai.AsyncOpenAI:
        http = httpx.AsyncClient(event_hooks={"response": [self]})
        return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=3,
                                  http_client=http)


def _touch_with(path: Path, text: str) -> None:
    """Write ``path`` so that its mtime changes (the gateway watches the mtime)."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    if path.stat().st_mtime_ns == before:
        os.utime(path, ns=(before, before + 1_000_000_000))


async def test_a_503_without_workers_is_retried_once_a_worker_joins(
        stack: Stack, tmp_path: Path, session: aiohttp.ClientSession) -> None:
    """With no worker the gateway answers 503 ``service_unavailable`` with ``retry-after``;
    the SDK retries after it and is served by the worker that joined meanwhile."""
    sidecars = tmp_path / "sidecars.txt"
    sidecars.write_text("")
    gateway = stack.gateway("gateway-joining", "--sidecar-file", str(sidecars),
                            wait_routable=False)

    async def a_worker_joins() -> None:
        _touch_with(sidecars, stack.sidecar.url + "\n")
        await routable(session, gateway.url, 1)

    hook = HeldRefusals(503, a_worker_joins)
    client = hook.client(gateway.url)
    try:
        completion = await client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=3)
    finally:
        await client.close()
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert hook.answers == [(503, "1"), (200, None)]


async def test_a_429_while_saturated_is_retried_once_capacity_returns(
        stack: Stack, session: aiohttp.ClientSession) -> None:
    """With its one slot taken (``--max-in-flight-per-worker 1``) the gateway answers 429
    with ``retry-after``; once the long request holding the slot ends, the SDK's retry is
    served."""
    gateway = stack.gateway("gateway-saturated", "--sidecar", stack.sidecar.url,
                            "--max-in-flight-per-worker", "1")
    held = await session.post(f"{gateway.url}/v1/completions", json={
        "model": MODEL_NAME, "prompt": "a long answer", "max_tokens": 4000,
        "ignore_eos": True, "stream": True})
    assert held.status == 200
    await held.content.readuntil(b"\n\n")  # generating: the slot is taken

    async def the_slot_frees() -> None:
        held.close()  # the long request's client goes away: the gateway aborts it

        async def idle() -> bool:
            async with session.get(f"{gateway.url}/v1/workers") as resp:
                workers = (await resp.json())["workers"]
            assert workers[0]["in_flight"] == 0, workers
            return True

        await eventually(idle, "the held request to be released", 30, 0.05)

    hook = HeldRefusals(429, the_slot_frees)
    client = hook.client(gateway.url)
    try:
        completion = await client.completions.create(model=MODEL_NAME, prompt="short",
                                                     max_tokens=3)
    finally:
        await client.close()
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert hook.answers == [(429, "1"), (200, None)]


async def test_no_worker_is_a_503_that_says_why_and_when(stack: Stack, tmp_path: Path) -> None:
    """Without a worker, the SDK (not retrying) sees 503 ``service_unavailable`` saying why,
    with ``retry-after``."""
    sidecars = tmp_path / "none.txt"
    sidecars.write_text("")
    gateway = stack.gateway("gateway-empty", "--sidecar-file", str(sidecars),
                            wait_routable=False)
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0)
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
    finally:
        await client.close()
    assert caught.value.status_code == 503 and caught.value.code == "service_unavailable"
    assert caught.value.response.headers["retry-after"] == "1"
    assert "no healthy worker" in caught.value.message
