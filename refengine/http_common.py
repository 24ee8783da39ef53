"""Helpers shared by the native and OpenAI HTTP routes: the app key, JSON in and out, output
text, and the engine stream with submission errors mapped to :class:`BadRequest`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import orjson
from aiohttp import web

from refengine.engine import Engine
from refengine.protocol import BadRequest
from refengine.request import Request
from refengine.scheduler import CapacityError
from refengine.tokenizer import ChatTokenizer

__all__ = [
    "ENGINE",
    "dumps",
    "error_response",
    "json_response",
    "output_text",
    "read_json",
    "run_stream",
]

ENGINE = web.AppKey("engine", Engine)


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json")


def error_response(message: str, status: int = 400) -> web.Response:
    return json_response({"error": {"message": message}}, status)


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc


def output_text(tokenizer: ChatTokenizer, req: Request) -> str:
    """The text of ``req``'s output so far. Mid-stream, without the last tokens whose bytes
    do not yet make whole characters (their text ends in U+FFFD), which SGLang's and vLLM's
    detokenizers hold back too: the client never has half a character, and the ids of the
    tokens whose text it has decode to exactly that text, which is what a stream migrated to
    another engine resumes from (``routing.pipeline.stream_tokens``)."""
    ids = req.output_ids
    text = tokenizer.decode(ids)
    if req.finish is None:
        held = len(ids)
        while held and text.endswith("\ufffd"):
            held -= 1
            text = tokenizer.decode(ids[:held])
    matched = req.finish.matched if req.finish else None
    if isinstance(matched, str) and matched in text:
        text = text[: text.index(matched)]
    return text


async def run_stream(engine: Engine, req: Request) -> AsyncGenerator[Request, None]:
    """``engine.generate`` with submission errors mapped to BadRequest."""
    try:
        gen = engine.generate(req)
        first = await anext(gen)
    except CapacityError as exc:
        raise BadRequest(str(exc)) from exc
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    except RuntimeError as exc:
        raise BadRequest(str(exc), status=503) from exc
    async with contextlib.aclosing(gen):
        yield first
        async for r in gen:
            yield r
