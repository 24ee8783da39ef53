"""OpenAI-compatible routes as SGLang serves them: ``/v1/completions``,
``/v1/chat/completions`` (both streaming), ``/v1/models``, and SGLang's ``/v1/tokenize``
(a prompt, or messages rendered as a chat completion would be).

A completion's ``prompt`` may be a batch (strings or token-id lists), and ``n`` samples each:
one choice per (prompt, sample), prompt-major, as OpenAI answers (``refengine.choices``). A
field the engine cannot honour (tools, structured output, logprobs, reasoning, images, LoRA
adapters) is refused with a 400 naming it, never dropped; ``chat_template_kwargs`` reach the
chat template. Usage carries ``prompt_tokens_details.cached_tokens`` (device +
host-tier tokens, as SGLang's cache report). Errors use SGLang's OpenAI ``ErrorResponse`` shape:
``{"object": "error", "message", "type": "BadRequestError", "param", "code"}``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

from aiohttp import web

from refengine.choices import MAX_CHOICES, follow, start
from refengine.engine import Engine
from refengine.http_common import (
    ENGINE,
    dumps,
    json_response,
    output_text,
    read_json,
)
from refengine.protocol import BadRequest, check_ids, parse_sampling
from refengine.request import Request

__all__ = ["add_routes", "chat_ids"]


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


def _text_ids(text: str, engine: Engine, name: str) -> list[int]:
    if not text:
        raise BadRequest(f"{name} must not be empty")
    return engine.tokenizer.encode(text)


def _prompts(body: dict[str, Any], engine: Engine) -> list[list[int]]:
    """The prompts of a completion: one (a string or token ids), or a batch (a list of
    strings or of token-id lists), as OpenAI's ``prompt`` takes them."""
    prompt, vocab = body.get("prompt"), engine.tokenizer.vocab_size
    if isinstance(prompt, str):
        return [_text_ids(prompt, engine, "prompt")]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [_text_ids(p, engine, f"prompt[{i}]") for i, p in enumerate(prompt)]
        if all(isinstance(p, list) for p in prompt):
            return [check_ids(p, vocab, f"prompt[{i}]") for i, p in enumerate(prompt)]
        return [check_ids(prompt, vocab, "prompt")]
    raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a "
                     "list of token-id lists")


def _prompt_ids(body: dict[str, Any], engine: Engine) -> list[int]:
    prompts = _prompts(body, engine)
    if len(prompts) != 1:
        raise BadRequest(f"expected one prompt, got a batch of {len(prompts)}")
    return prompts[0]


def chat_ids(body: dict[str, Any], engine: Engine) -> list[int]:
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


def _n(body: dict[str, Any], prompts: int) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadRequest(f"n must be an integer >= 1, got {n!r}")
    if n * prompts > MAX_CHOICES:
        raise BadRequest(f"{prompts} prompt(s) × n={n} asks for {n * prompts} choices; the "
                         f"reference engine serves at most {MAX_CHOICES} per request")
    return n


def _requests(body: dict[str, Any], engine: Engine, chat: bool) -> tuple[str, list[Request]]:
    """The response's id, and one engine request per choice, prompt-major (``i * n + j``:
    sample j of prompt i); with a seed, sample j draws with ``seed + j``."""
    prompts = [chat_ids(body, engine)] if chat else _prompts(body, engine)
    n = _n(body, len(prompts))
    sampling = _sampling(body, engine)
    sampling.pop("n")
    params = parse_sampling(sampling, engine.tokenizer.vocab_size)
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest("cache_salt must be a string")
    rid = body.get("rid") or ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    many = len(prompts) * n > 1
    return rid, [
        Request(f"{rid}-{i * n + j}" if many else rid, ids,
                params if j == 0 or params.seed is None else replace(params, seed=params.seed + j),
                salt)
        for i, ids in enumerate(prompts)
        for j in range(n)
    ]


def _batch_usage(reqs: list[Request], n: int) -> dict[str, Any]:
    """Each prompt counted once (its first sample's cache report), every sample's output."""
    firsts = reqs[::n]
    prompt = sum(len(r.prompt) for r in firsts)
    completion = sum(len(r.output_ids) for r in reqs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)},
    }


def _choice(engine: Engine, req: Request, index: int, chat: bool) -> dict[str, Any]:
    f = req.finish
    text = output_text(engine.tokenizer, req)
    base: dict[str, Any] = {"index": index}
    if chat:
        base["message"] = {"role": "assistant", "content": text, "reasoning_content": None,
                           "tool_calls": None}
    else:
        base["text"] = text
    return {**base, "logprobs": None, "finish_reason": f.openai if f else None,
            "matched_stop": f.matched if f and f.kind == "stop" else None}


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = _common_checks(await read_json(request), engine.cfg.model_name)
        rid, reqs = _requests(body, engine, chat)
        streams = await start(engine, reqs)
    except BadRequest as exc:
        return openai_error(str(exc), exc.status)
    model = body.get("model") or engine.cfg.model_name
    n = body.get("n") or 1
    created = int(time.time())
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return await _stream(request, engine, streams, reqs, chat, (rid, model, created),
                             include_usage, n)
    await follow(streams, _keep_going)
    for req in reqs:
        f = req.finish
        if f is not None and f.kind == "abort" and f.status_code:
            return openai_error(f.message or "aborted", f.status_code)
    return json_response(
        {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": [_choice(engine, r, k, chat) for k, r in enumerate(reqs)],
            "usage": _batch_usage(reqs, n),
        }
    )


async def _keep_going(ready: list[int]) -> bool:
    return True


async def _stream(
    request: web.Request,
    engine: Engine,
    streams: list[Any],
    reqs: list[Request],
    chat: bool,
    envelope: tuple[str, str, int],
    include_usage: bool,
    n: int,
) -> web.StreamResponse:
    """The choices as SSE chunks, each as its request advances (``envelope``: the
    response's id, model and ``created``)."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"
    rid, model, created = envelope

    async def send(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> None:
        chunk = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage,
        }
        await resp.write(b"data: " + dumps(chunk) + b"\n\n")

    if chat:
        for k in range(len(reqs)):
            await send([{"index": k, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}])
    sent = [""] * len(reqs)

    async def emit(ready: list[int]) -> bool:
        for k in ready:
            current = reqs[k]
            f = current.finish
            if f is not None and f.kind == "abort" and f.status_code:
                err = {"error": {"message": f.message, "type": "BadRequestError",
                                 "code": f.status_code}}
                await resp.write(b"data: " + dumps(err) + b"\n\n")
                return False
            text = output_text(engine.tokenizer, current)  # whole characters only (output_text)
            delta = text[len(sent[k]):]
            sent[k] = text if text.startswith(sent[k]) else sent[k]
            reason = f.openai if f else None
            if delta or reason:
                choice: dict[str, Any] = (
                    {"index": k, "delta": {"content": delta}, "logprobs": None,
                     "finish_reason": reason}
                    if chat
                    else {"index": k, "text": delta, "logprobs": None, "finish_reason": reason}
                )
                if reason:
                    choice["matched_stop"] = f.matched if f and f.kind == "stop" else None
                await send([choice])
        return True

    await follow(streams, emit)
    if include_usage:
        await send([], _batch_usage(reqs, n))
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
        ids = chat_ids(body, engine) if "messages" in body else _prompt_ids(body, engine)
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
