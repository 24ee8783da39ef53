"""HTTP helpers of the gateway tests: one-shot requests, SSE events, request bodies."""

from __future__ import annotations

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


def sse_events(body: bytes) -> list[bytes]:
    return [e[len(b"data: ") :] for e in body.split(b"\n\n") if e.startswith(b"data: ")]


def chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], **extra}
