"""A fake OpenAI-compatible engine for gateway tests (the engine boundary), served on port 0
from a thread of the test process::

    with FakeEngine().start() as engine:  # engine.url
        ...

Nothing in the gateway's tests needs it to be a process: its death is its sockets closing
(``stop()``), a frozen engine is one that takes no request on (``paused()``). Completion and
chat endpoints
answer ``fake_tokens`` (else ``max_tokens``, else 4) tokens, streamed as one SSE event each
when ``stream`` is true, with a usage chunk when ``stream_options.include_usage`` is set;
``fake_delay_s`` waits between tokens; ``fake_pad_bytes`` pads a non-streaming reply;
``fake_hang`` sends the first event and then waits until the client goes away.
``GET /_stats`` reports counts, aborted streams and the last requests seen (path,
x-request-id, body).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from aiohttp import web

from tests.support.loop_thread import LoopThread

__all__ = ["FakeEngine"]


@dataclass
class _State:
    """What one engine counted and saw, and whether it takes requests on (its gate)."""

    stats: dict[str, Any] = field(
        default_factory=lambda: {"requests": 0, "streams": 0, "aborted": 0, "active": 0})
    seen: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=500))
    taking: asyncio.Event = field(default_factory=asyncio.Event)


STATE = web.AppKey("state", _State)


def _usage(n: int) -> dict[str, Any]:
    return {
        "prompt_tokens": 8,
        "completion_tokens": n,
        "total_tokens": 8 + n,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def _chunk(chat: bool, i: int, last: bool) -> dict[str, Any]:
    finish = "length" if last else None
    if chat:
        choice = {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": finish}
        return {"id": "chatcmpl-x", "object": "chat.completion.chunk", "choices": [choice]}
    return {
        "id": "cmpl-x",
        "object": "text_completion",
        "choices": [{"index": 0, "text": f"t{i} ", "finish_reason": finish}],
    }


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    await state.taking.wait()
    chat = request.path.endswith("/chat/completions")
    body = await request.json()
    stats = state.stats
    stats["requests"] += 1
    state.seen.append(
        {
            "path": request.path,
            "request_id": request.headers.get("x-request-id"),
            "authorization": request.headers.get("authorization"),
            "body": body,
        }
    )
    n = int(body.get("fake_tokens") or body.get("max_tokens") or 4)
    delay = float(body.get("fake_delay_s") or 0)
    if not body.get("stream"):
        if delay:
            await asyncio.sleep(delay * n)
        text = "".join(f"t{i} " for i in range(n)) + "x" * int(body.get("fake_pad_bytes") or 0)
        choice = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
            if chat
            else {"index": 0, "text": text, "finish_reason": "length"}
        )
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion" if chat else "text_completion",
                "choices": [choice],
                "usage": _usage(n),
            }
        )
    stats["streams"] += 1
    stats["active"] += 1
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    try:
        await resp.prepare(request)
        for i in range(n):
            await resp.write(b"data: " + json.dumps(_chunk(chat, i, i == n - 1)).encode() + b"\n\n")
            if body.get("fake_hang"):
                await asyncio.Event().wait()  # until the client goes away (cancellation)
            if delay:
                await asyncio.sleep(delay)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": "x", "choices": [], "usage": _usage(n)}
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except (asyncio.CancelledError, ConnectionResetError):
        stats["aborted"] += 1
        raise
    finally:
        stats["active"] -= 1
    return resp


async def echo(request: web.Request) -> web.Response:
    """The other OpenAI routes: recorded, and answered with what came."""
    body = await request.json()
    request.app[STATE].seen.append({
        "path": request.path, "request_id": request.headers.get("x-request-id"),
        "authorization": request.headers.get("authorization"), "body": body})
    return web.json_response({"object": "echo", "path": request.path, "body": body})


def _app(model: str, state: _State) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({**state.stats, "seen": list(state.seen)})

    app = web.Application()
    app[STATE] = state
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    for path in ("/v1/responses", "/v1/messages", "/v1/embeddings", "/v1/tokenize"):
        app.router.add_post(path, echo)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/_stats", stats)
    return app


class FakeEngine:
    """One fake engine serving ``model`` on 127.0.0.1, port 0, from its own loop thread."""

    def __init__(self, model: str = "fake-model") -> None:
        self.model = model
        self.port = 0
        self._thread = LoopThread("fake-engine")
        self._runner: web.AppRunner | None = None
        self._state: _State | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeEngine:
        self._thread.start()
        self.port = self._thread.run(self._serve())
        return self

    async def _serve(self) -> int:
        self._state = _State()
        self._state.taking.set()
        # no grace at stop: the engine's sockets close at once, as a killed process's would
        self._runner = web.AppRunner(_app(self.model, self._state), handler_cancellation=True,
                                     access_log=None, shutdown_timeout=0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    def stop(self) -> None:
        """Close its sockets (the listener and every connection) and end its thread."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            self._thread.run(runner.cleanup())
        self._thread.close()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Requests that arrive in the block are taken on only once it is left."""
        state = self._state
        assert state is not None, "start() first"
        async def gate(taking: bool) -> None:
            (state.taking.set if taking else state.taking.clear)()

        self._thread.run(gate(False))  # closed before the caller sends anything
        try:
            yield
        finally:
            self._thread.run(gate(True))

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
