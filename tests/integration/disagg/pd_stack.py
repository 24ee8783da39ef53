"""Disaggregated stacks of the tests, on ``LocalStack``: engines by role with worker ids
``<role>-<i>`` numbered across the stack, gateways started one by one, and the helpers that
read what they answer."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import aiohttp

from kvcore.stream import Role
from kvsidecar.local_stack import DEFAULT_MODEL, EngineSpec, LocalStack, StackSpec
from tests.support.gateway import routable  # noqa: F401 (the disagg tests import it here)
from tests.support.polling import eventually
from tests.support.stacks import gateway  # noqa: F401 (the disagg tests import it here)

MODEL = DEFAULT_MODEL


def pd_stack(tmp: Path, engines: Sequence[Role | EngineSpec], *,
             compute: Literal["sim", "torch"] = "sim", speedup: float = 4.0,
             **spec: Any) -> LocalStack:
    """A started stack of one engine process per entry (a role, or an ``EngineSpec`` of one
    replica), each with its sidecar, worker ids ``<role>-<i>`` by position, no gateway yet;
    ``spec`` goes to ``StackSpec``. The caller stops it."""
    specs = []
    for i, entry in enumerate(engines):
        engine = EngineSpec(role=entry) if isinstance(entry, str) else entry
        specs.append(dataclasses.replace(engine, compute=compute,
                                         worker_ids=(f"{engine.role}-{i}",)))
    stack = StackSpec(engines=tuple(specs), gateways=(), speedup=speedup, **spec)
    return LocalStack(stack, tmp).start()


async def complete(
    session: aiohttp.ClientSession,
    url: str,
    prompt: str,
    max_tokens: int,
    *,
    stream: bool = False,
    chat: bool = False,
) -> tuple[int, str, dict[str, Any]]:
    """(status, x-kvsidecar-worker, body) with a streamed reply folded into one body:
    ``{"text", "finish_reason", "usage", "chunks", "error"}`` (an in-stream error event)."""
    body: dict[str, Any] = {"model": "tiny", "max_tokens": max_tokens, "stream": stream,
                            "temperature": 0, "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with session.post(url + path, json=body) as resp:
        worker = resp.headers.get("x-kvsidecar-worker", "")
        if not stream or resp.status != 200:
            return resp.status, worker, await resp.json(content_type=None)
        lines = [line.strip() async for line in resp.content if line.startswith(b"data:")]
    assert lines[-1] == b"data: [DONE]"
    chunks = [json.loads(line[5:]) for line in lines[:-1]]
    text, finish, usage, error = "", None, None, None
    for c in chunks:
        error = c.get("error") or error
        for choice in c.get("choices", ()):
            piece = choice.get("text")
            if piece is None:
                piece = (choice.get("delta") or {}).get("content") or ""
            text += piece
            finish = choice.get("finish_reason") or finish
        usage = c.get("usage") or usage
    return 200, worker, {"text": text, "finish_reason": finish, "usage": usage,
                         "chunks": len(chunks), "error": error}


def answer_text(body: dict[str, Any]) -> str:
    """The generated text of a non-streamed completion or chat body."""
    choice = body["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


async def capacity_known(
    session: aiohttp.ClientSession, url: str, worker_id: str, blocks: int
) -> None:
    """Poll the gateway's /v1/workers until it knows ``worker_id``'s KV capacity: a sidecar
    reports it on its status, up to a load-report interval after its stream is up, and
    until then the gateway finds room on that worker for any request."""

    async def known() -> bool:
        async with session.get(f"{url}/v1/workers") as resp:
            workers = (await resp.json())["workers"]
        seen = {w["worker_id"]: w["capacity_blocks"] for w in workers}
        assert seen.get(worker_id) == blocks, f"capacity {seen} at {url}"
        return True

    await eventually(known, f"{worker_id}'s capacity at {url}", 30.0, 0.05)


async def metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    """One sample of the gateway's /metrics (exact name with labels)."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


async def metric_reaches(session: aiohttp.ClientSession, url: str, name: str, value: float,
                         timeout_s: float = 4.0) -> None:
    """Poll the gateway's /metrics until ``name`` is ``value`` (by default for 4 s: less
    than an engine may stay paused, see ``ManagedProcess.paused``)."""

    async def reached() -> bool:
        seen = await metric(session, url, name)
        assert seen == value, f"{name} is {seen:g}"
        return True

    await eventually(reached, f"{name} = {value:g} at {url}", timeout_s, 0.02)
