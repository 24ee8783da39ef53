"""OpenAI-compatible routes as SGLang serves them: ``/v1/completions``,
``/v1/chat/completions`` (both streaming), ``/v1/models``, and SGLang's ``/v1/tokenize``
(a prompt, or messages rendered as a chat completion would be).

A field the engine cannot honour (tools, structured output, logprobs, reasoning, images, LoRA
adapters, ``n`` > 1) is refused with a 400 naming it, never dropped; ``chat_template_kwargs``
reach the chat template. Usage carries ``prompt_tokens_details.cached_tokens`` (device +
host-tier tokens, as SGLang's cache report). Errors use SGLang's OpenAI ``ErrorResponse`` shape:
``{"object": "error", "message", "type": "BadRequestError", "param", "code"}``.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

from aiohttp import web

from refengine.engine import Engine
from refengine.http_common import (
    ENGINE,
    dumps,
    json_response,
    output_text,
    read_json,
    run_stream,
)
from refengine.protocol import BadRequest, check_ids, parse_sampling
from refengine.request import Request

__all__ = ["add_routes"]


def openai_error(
    message: str, status: int = 400, err_type: str = "BadRequestError"
) -> web.Response:
    return json_response(
        {"object": "error", "message": message, "type": err_type, "param": None, "code": status},
        status,
    )


def _sampling(body: dict[str, Any], engine: Engine) -> dict[str, Any]:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    raw: dict[str, Any] = {
        "max_new_tokens": 16 if max_tokens is None and "messages" not in body else max_tokens,
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "stop": body.get("stop"),
        "n": body.get("n", 1),
    }
    if raw["max_new_tokens"] is None:  # chat default: up to the context limit, capped
        raw["max_new_tokens"] = 128
    for key in ("top_k", "min_tokens", "ignore_eos", "stop_token_ids", "seed",
                "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if body.get(key) is not None:
            raw["min_new_tokens" if key == "min_tokens" else key] = body[key]
    return raw


def _usage(req: Request) -> dict[str, Any]:
    return {
        "prompt_tokens": len(req.prompt),
        "completion_tokens": len(req.output_ids),
        "total_tokens": len(req.prompt) + len(req.output_ids),
        "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
    }


def _common_checks(body: Any, served: str) -> dict[str, Any]:
    """Refuse what the reference engine cannot honour, naming it: a field it would otherwise
    drop silently (it has no tool-call or reasoning parser, no grammar backend, no LoRA)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise BadRequest("logprobs are not supported by the reference engine")
    if body.get("echo"):
        raise BadRequest("echo is not supported by the reference engine")
    tool_choice = body.get("tool_choice")
    if body.get("tools") or tool_choice not in (None, "none", "auto"):
        raise BadRequest("tools are not supported by the reference engine (no tool-call parser)")
    response_format = body.get("response_format")
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if kind not in (None, "text"):
        raise BadRequest(f"response_format {kind!r} is not supported by the reference engine "
                         "(no grammar backend)")
    for key in ("regex", "ebnf", "json_schema", "structural_tag"):
        if body.get(key) is not None:
            raise BadRequest(f"{key} is not supported by the reference engine "
                             "(no grammar backend)")
    if body.get("reasoning_effort") not in (None, "none") or body.get("reasoning"):
        raise BadRequest("reasoning is not supported by the reference engine "
                         "(no reasoning parser)")
    model = body.get("model")
    if body.get("lora_path") or (
        isinstance(model, str) and ":" in model and model != served
    ):
        raise BadRequest("LoRA adapters are not supported by the reference engine")
    return body


def _prompt_ids(body: dict[str, Any], engine: Engine) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt must not be empty")
        return engine.tokenizer.encode(prompt)
    if isinstance(prompt, list):
        return check_ids(prompt, engine.tokenizer.vocab_size, "prompt")
    raise BadRequest("prompt must be a string or a list of token ids (one prompt per request)")


def _chat_ids(body: dict[str, Any], engine: Engine) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    norm = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message needs a string role")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = [p.get("text", "") for p in content if isinstance(p, dict)]
            if len(parts) != len(content) or any(p.get("type") != "text" for p in content):
                raise BadRequest("only text content parts are supported")
            content = "".join(parts)
        if not isinstance(content, str):
            raise BadRequest("message content must be a string or a list of text parts")
        norm.append({"role": m["role"], "content": content})
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object")
    try:
        rendered = engine.tokenizer.apply_chat_template(norm, kwargs)
        return engine.tokenizer.encode(rendered)
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = _common_checks(await read_json(request), engine.cfg.model_name)
        ids = _chat_ids(body, engine) if chat else _prompt_ids(body, engine)
        params = parse_sampling(_sampling(body, engine), engine.tokenizer.vocab_size)
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise BadRequest("cache_salt must be a string")
        prefix = "chatcmpl-" if chat else "cmpl-"
        req = Request(body.get("rid") or prefix + uuid.uuid4().hex, ids, params, salt)
        model = body.get("model") or engine.cfg.model_name
        stream = run_stream(engine, req)
        first = await anext(stream)
    except BadRequest as exc:
        return openai_error(str(exc), exc.status)
    created = int(time.time())
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return await _stream(request, engine, stream, first, chat, model, created, include_usage)
    async with contextlib.aclosing(stream):
        async for _ in stream:
            pass
    f = req.finish
    if f is not None and f.kind == "abort" and f.status_code:
        return openai_error(f.message or "aborted", f.status_code)
    text = output_text(engine, req)
    reason = f.openai if f else None
    matched = f.matched if f and f.kind == "stop" else None
    choice: dict[str, Any] = (
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": text,
                "reasoning_content": None,
                "tool_calls": None,
            },
            "logprobs": None,
            "finish_reason": reason,
            "matched_stop": matched,
        }
        if chat
        else {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": reason,
            "matched_stop": matched,
        }
    )
    return json_response(
        {
            "id": req.rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": _usage(req),
        }
    )


async def _stream(
    request: web.Request,
    engine: Engine,
    stream: Any,
    first: Request,
    chat: bool,
    model: str,
    created: int,
    include_usage: bool,
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"

    async def send(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> None:
        chunk = {
            "id": first.rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage,
        }
        await resp.write(b"data: " + dumps(chunk) + b"\n\n")

    if chat:
        await send(
            [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
    sent = ""
    async with contextlib.aclosing(stream):
        current: Request | None = first
        while current is not None:
            f = current.finish
            if f is not None and f.kind == "abort" and f.status_code:
                err = {
                    "error": {
                        "message": f.message,
                        "type": "BadRequestError",
                        "code": f.status_code,
                    }
                }
                await resp.write(b"data: " + dumps(err) + b"\n\n")
                break
            text = output_text(engine, current)
            if f is None and text.endswith("\ufffd"):
                text = text[:-1]  # an incomplete UTF-8 sequence: wait for its next token
            delta, sent = text[len(sent) :], text if text.startswith(sent) else sent
            reason = f.openai if f else None
            if delta or reason:
                body = {"content": delta} if chat else None
                choice: dict[str, Any] = (
                    {"index": 0, "delta": body, "logprobs": None, "finish_reason": reason}
                    if chat
                    else {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
                )
                if reason:
                    choice["matched_stop"] = f.matched if f and f.kind == "stop" else None
                await send([choice])
            current = await anext(stream, None)
    if include_usage:
        await send([], _usage(first))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def tokenize(request: web.Request) -> web.Response:
    """SGLang's ``/v1/tokenize``: exactly one of ``prompt`` and ``messages``; messages are
    rendered and encoded as ``/v1/chat/completions`` would."""
    engine = request.app[ENGINE]
    try:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if ("prompt" in body) == ("messages" in body):
            raise BadRequest("Exactly one of 'prompt' or 'messages' must be provided.")
        ids = _chat_ids(body, engine) if "messages" in body else _prompt_ids(body, engine)
    except BadRequest as exc:
        return openai_error(str(exc), exc.status)
    return json_response({
        "tokens": ids,
        "count": len(ids),
        "max_model_len": engine.model_cfg.max_position_embeddings,
    })


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": engine.cfg.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "sglang",
                    "root": engine.cfg.model_name,
                    "max_model_len": engine.model_cfg.max_position_embeddings,
                }
            ],
        }
    )


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/tokenize", tokenize)
    app.router.add_post("/tokenize", tokenize)
