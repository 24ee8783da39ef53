"""A fake OpenAI-compatible engine for gateway tests (the engine boundary; run as a process).

    python fake_openai.py [--port 0] [--model fake-model]

Prints ``FAKE_ENGINE_PORT=<port>`` on stdout once listening. Completion and chat endpoints
answer ``fake_tokens`` (else ``max_tokens``, else 4) tokens, streamed as one SSE event each
when ``stream`` is true, with a usage chunk when ``stream_options.include_usage`` is set;
``fake_delay_s`` waits between tokens; ``fake_pad_bytes`` pads a non-streaming reply;
``fake_hang`` sends the first event and then waits until the client goes away.
``GET /_stats`` reports counts, aborted streams and the last requests seen (path,
x-request-id, body).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import deque
from typing import Any

from aiohttp import web

STATS: dict[str, Any] = {"requests": 0, "streams": 0, "aborted": 0, "active": 0}
SEEN: deque[dict[str, Any]] = deque(maxlen=500)


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
    chat = request.path.endswith("/chat/completions")
    body = await request.json()
    STATS["requests"] += 1
    SEEN.append(
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
    STATS["streams"] += 1
    STATS["active"] += 1
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
        STATS["aborted"] += 1
        raise
    finally:
        STATS["active"] -= 1
    return resp


async def echo(request: web.Request) -> web.Response:
    """The other OpenAI routes: recorded, and answered with what came."""
    body = await request.json()
    SEEN.append({"path": request.path, "request_id": request.headers.get("x-request-id"),
                 "authorization": request.headers.get("authorization"), "body": body})
    return web.json_response({"object": "echo", "path": request.path, "body": body})


async def main(port: int, model: str) -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    for path in ("/v1/responses", "/v1/messages", "/v1/embeddings", "/v1/tokenize"):
        app.router.add_post(path, echo)
    app.router.add_get("/health", lambda _: web.Response(text="ok"))
    app.router.add_get(
        "/v1/models",
        lambda _: web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]}),
    )
    app.router.add_get("/_stats", lambda _: web.json_response({**STATS, "seen": list(SEEN)}))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"FAKE_ENGINE_PORT={bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model", default="fake-model")
    args = ap.parse_args()
    try:
        asyncio.run(main(args.port, args.model))
    except KeyboardInterrupt:
        sys.exit(0)
