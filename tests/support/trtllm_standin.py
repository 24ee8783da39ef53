"""A test-only stand-in for ``trtllm-serve``'s OpenAI surface; the deterministic model of
``standin_model`` behind it.

    python -m tests.support.trtllm_standin --model-path DIR --served-model-name NAME \
        [--lora ADAPTER]... --ready-file FILE [--port 0]

trtllm-serve cannot run here (no TensorRT-LLM on CPU), so this speaks the part of its HTTP
surface a sidecar uses: ``/health``, ``/v1/models``, ``/v1/completions`` (token-id prompts
included), ``/v1/chat/completions`` (both streamed or not) and ``POST /kv_cache_events``
(TensorRT-LLM's event JSON, one ``stored`` event per new full page of each prompt).

Requests are validated as trtllm-serve's pydantic request models do, written here from its
``tensorrt_llm/serve/openai_protocol.py``: every model forbids extra fields (an unknown field
is a 400, unlike SGLang, which ignores it); ``stream_options`` needs ``stream``; a LoRA adapter
is chosen by ``lora_request`` (``lora_name`` and ``lora_int_id`` both required), never by the
model name; structured output is ``response_format`` (``json_schema``, ``json_object``,
``regex``, ``ebnf``); ``tool_choice`` defaults to ``none``. A failure answers 400 with
trtllm-serve's ``ErrorResponse`` shape and is recorded (``GET /_standin/requests``).
This is a modest model of the protocol, not a copy: fields trtllm-serve has that no test
here sends are left out, and are therefore refused like unknown ones.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any, Literal

import aiohttp
import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tests.support.standin_http import (
    RECORDER,
    PageCache,
    base_args,
    image_digest,
    serve_until_signal,
)
from tests.support.standin_model import Ask, Choice, StandinError, StandinModel

# --- trtllm-serve's request models, as much of them as the tests send ------------------------


class _Forbid(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(_Forbid):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class LoRARequest(_Forbid):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_ckpt_source: str = "hf"


class ResponseFormat(_Forbid):
    type: Literal["text", "json", "json_schema", "json_object", "regex", "ebnf",
                  "structural_tag"]
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None


class FunctionDefinition(_Forbid):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(_Forbid):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Forbid):
    name: str


class NamedToolChoice(_Forbid):
    function: NamedFunction
    type: Literal["function"] = "function"


class _Sampling(_Forbid):
    model: str
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    min_p: float = 0.0
    user: str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    lora_request: LoRARequest | None = None
    response_format: ResponseFormat | None = None
    priority: float | None = Field(default=None, ge=0.0, le=1.0)

    @model_validator(mode="before")
    @classmethod
    def _stream_options_need_stream(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise ValueError("Stream options can only be defined when stream is true.")
        return data


class CompletionRequest(_Sampling):
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = False


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(default=None, validation_alias="max_tokens")
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = "none"
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["low", "medium", "high", "max", "none"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    cache_salt: str | None = None


# --- the server ---------------------------------------------------------------------------


class Server:
    def __init__(self, args: Any) -> None:
        from transformers import AutoTokenizer

        self.args = args
        self.name = args.served_model_name
        self.tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        self.model = StandinModel(self.tokenizer)
        self.adapters = set(args.lora)
        self.cache = PageCache(args.page_size)
        self._next_id = 0
        self.events: list[dict[str, Any]] = [self._envelope(
            {"type": "created", "num_blocks_per_cache_level": [4096, 0]})]
        self.session: aiohttp.ClientSession | None = None

    def _envelope(self, data: dict[str, Any]) -> dict[str, Any]:
        envelope = {"event_id": self._next_id, "data": data, "window_size": 8192}
        self._next_id += 1
        return envelope

    def admit(self, ids: list[int]) -> int:
        cached, pages = self.cache.admit(ids)
        for page, parent, tokens in pages:
            block = {
                "type": "stored_block",
                "block_hash": page,
                "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                           for t in tokens],
                "cache_level": 0,
                "priority": 35,
            }
            self.events.append(self._envelope(
                {"type": "stored", "parent_hash": parent, "blocks": [block]}))
        return cached

    def adapter(self, lora: LoRARequest | None) -> str | None:
        if lora is None:
            return None
        if lora.lora_name not in self.adapters:
            raise StandinError(f"LoRA adapter {lora.lora_name!r} is not available "
                               f"(served: {sorted(self.adapters)})")
        if lora.lora_path and not os.path.isdir(lora.lora_path):
            # the engine loads the checkpoint from lora_path
            raise StandinError(f"LoRA checkpoint {lora.lora_path!r} does not exist")
        return lora.lora_name


SERVER = web.AppKey("server", Server)


def _error(message: str, status: int = 400, err_type: str = "BadRequestError") -> web.Response:
    body = {"object": "error", "message": message, "type": err_type, "param": None,
            "code": status}
    return web.json_response(body, status=status)


async def _validated(request: web.Request, model: type[_Sampling]) -> tuple[Any, Any]:
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = raw.decode("utf-8", "replace")
    record = request.app[RECORDER].add(request, body)
    try:
        return body, model.model_validate(body)
    except ValidationError as exc:
        record.valid, record.error = False, str(exc)
        raise StandinError(str(exc)) from exc


def _common(req: _Sampling) -> dict[str, Any]:
    rf = req.response_format
    json_schema: Any = None
    regex = ebnf = None
    if rf is not None:
        if rf.type == "json_object":
            json_schema = True
        elif rf.type in ("json", "json_schema"):
            raw = rf.schema_ if rf.type == "json" else rf.json_schema
            if raw is None:
                raise StandinError(f"response_format.{rf.type} needs a schema")
            json_schema = raw.get("schema", raw) if rf.type == "json_schema" else raw
        elif rf.type == "regex":
            regex = rf.regex
        elif rf.type == "ebnf":
            ebnf = rf.ebnf
    stop = req.stop
    return {
        "stop": (stop,) if isinstance(stop, str) else tuple(stop or ()),
        "stop_token_ids": tuple(req.stop_token_ids or ()),
        "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "seed": req.seed,
        "penalized": bool(req.presence_penalty) or bool(req.frequency_penalty)
        or req.repetition_penalty != 1.0,
        "n": req.n,
        "json_schema": json_schema,
        "regex": regex,
        "ebnf": ebnf,
    }


def _usage(ids: list[int], choices: list[Choice], cached: int) -> dict[str, Any]:
    completion = sum(len(c.ids) for c in choices)
    return {"prompt_tokens": len(ids), "total_tokens": len(ids) + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _stop_reason(choice: Choice) -> int | str | None:
    return choice.matched_stop if choice.finish_reason == "stop" else None


async def _sse(request: web.Request, chunks: list[dict[str, Any]]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for chunk in chunks:
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER]
    try:
        _, req = await _validated(request, CompletionRequest)
        lora = server.adapter(req.lora_request)
        prompt = req.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = list(server.tokenizer.encode(prompt))
        elif prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise StandinError("stand-in: a batch of prompts is not modelled")
        ask = Ask(prompt_ids=ids, max_tokens=req.max_tokens or 16, lora=lora,
                  top_logprobs=req.logprobs, **_common(req))
        choices = server.model.answer(ask)
    except StandinError as exc:
        return _error(str(exc))
    cached = server.admit(ids)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    usage = _usage(ids, choices, cached)

    def logprobs(entries: list[Any] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        return {"text_offset": [], "token_logprobs": [lp for _, lp, _ in entries],
                "tokens": [t for t, _, _ in entries],
                "top_logprobs": [dict(top) for _, _, top in entries]}

    def envelope(body_choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": created,
                "model": req.model, "choices": body_choices}

    if not req.stream:
        body = envelope([{"index": c.index, "text": c.text, "token_ids": None,
                          "logprobs": logprobs(c.logprobs), "finish_reason": c.finish_reason,
                          "stop_reason": _stop_reason(c)} for c in choices])
        body["usage"] = usage
        return web.json_response(body)
    chunks = []
    for c in choices:
        chunks += [envelope([{"index": c.index, "text": d, "logprobs": None,
                              "finish_reason": None, "stop_reason": None}]) for d in c.deltas]
        chunks.append(envelope([{"index": c.index, "text": "",
                                 "logprobs": logprobs(c.logprobs),
                                 "finish_reason": c.finish_reason,
                                 "stop_reason": _stop_reason(c)}]))
    if req.stream_options is not None and req.stream_options.include_usage:
        chunks.append({**envelope([]), "usage": usage})
    return await _sse(request, chunks)


async def _chat_prompt(server: Server, req: ChatCompletionRequest) -> tuple[list[int], Any]:
    assert server.session is not None
    messages, digests, last_user = [], [], ""
    for message in req.messages:
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") == "image_url":
                    url = (part.get("image_url") or {}).get("url", "")
                    digests.append(await image_digest(server.session, url))
                    texts.append("<image>")
                elif part.get("type") == "text":
                    texts.append(str(part.get("text", "")))
                else:
                    raise StandinError(f"stand-in: content part {part.get('type')!r} "
                                       "is not modelled")
            content = "".join(texts)
        if message.get("role") == "user":
            last_user = content or ""
        messages.append({"role": message.get("role"), "content": content or ""})
    tools = [t.model_dump() for t in req.tools] if req.tools else None
    template: Any = server.tokenizer.apply_chat_template
    rendered = template(messages, tools=tools, add_generation_prompt=req.add_generation_prompt,
                        tokenize=False, **(req.chat_template_kwargs or {}))
    return list(server.tokenizer.encode(rendered, add_special_tokens=False)), (
        tuple(digests), last_user)


def _chat_logprobs(entries: list[Any] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {"content": [
        {"token": t, "logprob": lp, "bytes": list(t.encode()),
         "top_logprobs": [{"token": a, "logprob": v, "bytes": list(a.encode())}
                          for a, v in top]}
        for t, lp, top in entries]}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER]
    try:
        _, req = await _validated(request, ChatCompletionRequest)
        lora = server.adapter(req.lora_request)
        ids, (digests, last_user) = await _chat_prompt(server, req)
        choice_of = req.tool_choice or "none"
        if isinstance(choice_of, NamedToolChoice):
            choice_of = choice_of.function.name
        kwargs = req.chat_template_kwargs or {}
        thinking = (req.reasoning_effort not in (None, "none")
                    or bool(kwargs.get("enable_thinking") or kwargs.get("thinking")))
        ask = Ask(
            prompt_ids=ids, max_tokens=req.max_completion_tokens or 128, lora=lora,
            tools=tuple(t.model_dump() for t in req.tools or ()),
            tool_choice=choice_of if req.tools else "none",
            thinking=thinking, last_user_text=last_user, image_digests=digests,
            top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            **_common(req),
        )
        choices = server.model.answer(ask)
    except StandinError as exc:
        return _error(str(exc))
    cached = server.admit(ids)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    usage = _usage(ids, choices, cached)

    def calls(c: Choice, stream: bool) -> list[dict[str, Any]]:
        return [{"id": t.id, "type": "function", **({"index": k} if stream else {}),
                 "function": {"name": t.name, "arguments": t.arguments}}
                for k, t in enumerate(c.tool_calls)]

    def envelope(obj: str, body_choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": rid, "object": obj, "created": created, "model": req.model,
                "choices": body_choices}

    if not req.stream:
        body = envelope("chat.completion", [
            {"index": c.index,
             "message": {"role": "assistant", "content": c.text or None,
                         "reasoning_content": c.reasoning, "tool_calls": calls(c, False)},
             "logprobs": _chat_logprobs(c.logprobs), "finish_reason": c.finish_reason,
             "stop_reason": _stop_reason(c)}
            for c in choices])
        body["usage"] = usage
        return web.json_response(body)
    chunks = []
    for c in choices:

        def chunk(delta: dict[str, Any], c: Choice = c, **extra: Any) -> dict[str, Any]:
            return envelope("chat.completion.chunk", [
                {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None,
                 **extra}])

        chunks.append(chunk({"role": "assistant", "content": ""}))
        if c.reasoning is not None:
            chunks.append(chunk({"reasoning_content": c.reasoning}))
        chunks += [chunk({"content": d}) for d in c.deltas]
        if c.tool_calls:
            chunks.append(chunk({"tool_calls": calls(c, True)}))
        chunks.append(chunk({}, logprobs=_chat_logprobs(c.logprobs),
                            finish_reason=c.finish_reason, stop_reason=_stop_reason(c)))
    if req.stream_options is not None and req.stream_options.include_usage:
        chunks.append({**envelope("chat.completion.chunk", []), "usage": usage})
    return await _sse(request, chunks)


async def kv_cache_events(request: web.Request) -> web.Response:
    """Drains the event queue, as trtllm-serve's ``POST /kv_cache_events`` does."""
    server = request.app[SERVER]
    events, server.events = server.events, []
    return web.json_response(events)


async def models(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    card = {"id": server.name, "object": "model", "created": 0, "owned_by": "tensorrt_llm"}
    return web.json_response({"object": "list", "data": [card]})


async def _main() -> None:
    args = base_args("trtllm_standin", "A test-only trtllm-serve stand-in.").parse_args()
    server = Server(args)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[SERVER] = server
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/kv_cache_events", kv_cache_events)
    await serve_until_signal(app, args, server)


if __name__ == "__main__":
    asyncio.run(_main())
