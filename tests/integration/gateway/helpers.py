"""HTTP helpers for gateway tests (imported by path from the test modules)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson


async def post(
    url: str, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with aiohttp.ClientSession() as s, s.post(url + path, data=data, headers=headers) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


async def get_json(url: str, path: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        return await r.json(content_type=None)


async def get(url: str, path: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        return r.status, await r.read()


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """Poll ``check`` until it is true, failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        await asyncio.sleep(0.02)


def sse_events(body: bytes) -> list[bytes]:
    return [e[len(b"data: ") :] for e in body.split(b"\n\n") if e.startswith(b"data: ")]


def chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], **extra}
