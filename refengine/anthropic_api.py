"""Anthropic's Messages API as SGLang serves it beside OpenAI's: ``POST /v1/messages``.

The conversation (``system``, then ``messages`` of text content) goes through the chat
template as a chat completion's would; the answer is one ``message`` with a text block, or
its SSE events (``message_start``, ``content_block_start``, ``content_block_delta`` ...
``message_stop``). Usage in Anthropic's terms: ``input_tokens`` are the prompt tokens not
read from the cache, ``cache_read_input_tokens`` those that were. Errors are Anthropic's
shape, ``{"type": "error", "error": {"type", "message"}}``. Like the OpenAI routes, a field
the engine cannot honour (tools, thinking, images) is refused with a 400 naming it.
"""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from refengine.choices import follow, start
from refengine.engine import Engine
from refengine.http_common import ENGINE, dumps, json_response, output_text, read_json
from refengine.openai_api import chat_ids
from refengine.protocol import BadRequest, parse_sampling
from refengine.request import Request

__all__ = ["add_routes"]

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def _error_body(message: str, status: int) -> dict[str, Any]:
    kind = _TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error(message: str, status: int = 400) -> web.Response:
    return json_response(_error_body(message, status), status)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if not all(isinstance(b, dict) and b.get("type") == "text"
                   and isinstance(b.get("text"), str) for b in content):
            raise BadRequest(f"{where}: only text content blocks are supported by the "
                             "reference engine")
        return "".join(b["text"] for b in content)
    raise BadRequest(f"{where} must be a string or a list of content blocks")


def _chat_body(body: Any) -> dict[str, Any]:
    """The OpenAI chat request the Messages request is."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name in ("tools", "thinking", "mcp_servers"):
        if body.get(name):
            raise BadRequest(f"{name} is not supported by the reference engine")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest(f"max_tokens is required, an integer >= 1; got {max_tokens!r}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    chat: list[dict[str, str]] = []
    if body.get("system") is not None:
        chat.append({"role": "system", "content": _text(body["system"], "system")})
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadRequest(f"messages[{i}].role must be 'user' or 'assistant'")
        chat.append({"role": m["role"], "content": _text(m.get("content"), f"messages[{i}]")})
    stop = body.get("stop_sequences")
    if stop is not None and not (isinstance(stop, list)
                                 and all(isinstance(s, str) for s in stop)):
        raise BadRequest("stop_sequences must be a list of strings")
    out: dict[str, Any] = {"messages": chat, "max_tokens": max_tokens, "stop": stop}
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            out[name] = body[name]
    return out


def _request(body: Any, engine: Engine) -> Request:
    chat = _chat_body(body)
    raw = {"max_new_tokens": chat["max_tokens"], "stop": chat["stop"],
           "temperature": chat.get("temperature", 1.0), "top_p": chat.get("top_p", 1.0)}
    if "top_k" in chat:
        raw["top_k"] = chat["top_k"]
    params = parse_sampling(raw, engine.tokenizer.vocab_size)
    return Request("msg_" + uuid.uuid4().hex, chat_ids(chat, engine), params)


def _stop(req: Request) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished request."""
    f = req.finish
    if f is None:
        return None, None
    if f.kind == "length":
        return "max_tokens", None
    if isinstance(f.matched, str):
        return "stop_sequence", f.matched
    return "end_turn", None


def _usage(req: Request) -> dict[str, Any]:
    return {
        "input_tokens": len(req.prompt) - req.cached_tokens,
        "cache_read_input_tokens": req.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": len(req.output_ids),
    }


def _message(req: Request, model: str, text: str | None) -> dict[str, Any]:
    reason, sequence = _stop(req)
    return {
        "id": req.rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [] if text is None else [{"type": "text", "text": text}],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(req),
    }


async def messages(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = await read_json(request)
        req = _request(body, engine)
        streams = await start(engine, [req])
    except BadRequest as exc:
        return anthropic_error(str(exc), exc.status)
    model = body.get("model") or engine.cfg.model_name
    if body.get("stream"):
        return await _stream(request, engine, streams, req, model)
    await follow(streams, _keep_going)
    f = req.finish
    if f is not None and f.kind == "abort":
        return anthropic_error(f.message or "aborted", f.status_code or 500)
    return json_response(_message(req, model, output_text(engine.tokenizer, req)))


async def _keep_going(ready: list[int]) -> bool:
    return True


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + dumps(data) + b"\n\n"


async def _stream(request: web.Request, engine: Engine, streams: list[Any], req: Request,
                  model: str) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    start_message = _message(req, model, None)
    start_message.update(stop_reason=None, stop_sequence=None)
    start_message["usage"]["output_tokens"] = 0
    await resp.write(_event("message_start", {"type": "message_start", "message": start_message})
                     + _event("content_block_start", {"type": "content_block_start", "index": 0,
                                                      "content_block": {"type": "text",
                                                                        "text": ""}}))
    sent = ""
    failed = False

    async def emit(ready: list[int]) -> bool:
        nonlocal sent, failed
        f = req.finish
        if f is not None and f.kind == "abort":
            failed = True
            error = _error_body(f.message or "aborted", f.status_code or 500)
            await resp.write(_event("error", error))
            return False
        text = output_text(engine.tokenizer, req)  # whole characters only (output_text)
        delta = text[len(sent):]
        if delta and text.startswith(sent):
            sent = text
            await resp.write(_event("content_block_delta", {
                "type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": delta}}))
        return True

    await follow(streams, emit)
    if not failed:
        reason, sequence = _stop(req)
        await resp.write(
            _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            + _event("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": len(req.output_ids)}})
            + _event("message_stop", {"type": "message_stop"}))
    await resp.write_eof()
    return resp


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
