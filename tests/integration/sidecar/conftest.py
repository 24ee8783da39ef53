"""What the sidecar's process tests share: their child processes, and trtllm-serve's routes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvsidecar.launch import ManagedProcess
from tests.support.processes import ProcessGroup


@pytest.fixture
def procs() -> Iterator[ProcessGroup[ManagedProcess]]:
    with ProcessGroup[ManagedProcess]() as started:
        yield started


@pytest.fixture
async def standin() -> AsyncIterator[str]:
    """trtllm-serve's routes a sidecar reads, with events pushed: nothing to drain."""
    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def drain(_: web.Request) -> web.Response:
        return web.json_response([])

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/kv_cache_events", drain)
    async with TestServer(app, host="127.0.0.1") as server:
        yield str(server.make_url("")).rstrip("/")
