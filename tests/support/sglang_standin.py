"""A test-only stand-in for an SGLang 0.5.23 server: its HTTP surface, its request validation,
its response models; a deterministic model (``standin_model``) behind them.

    python -m tests.support.sglang_standin --model-path DIR --served-model-name NAME \
        [--lora ADAPTER]... --ready-file FILE [--port 0]

Routes, as SGLang serves them: ``/health``, ``/v1/models``, ``/server_info`` (and the
deprecated ``/get_server_info``) with the ``kv_events`` block of
``describe_kv_events_publisher``, ``/v1/tokenize``, ``/generate``, ``/v1/completions`` and
``/v1/chat/completions`` (streamed or not). KV events come from SGLang's own
``ZmqEventPublisher`` (loopback, ephemeral ports, with replay), one ``BlockStored`` per new
full page of each prompt served, so a subscriber sees a live cache.

Every body is validated with SGLang's own code before anything else: ``/generate`` as
FastAPI parses ``GenerateReqInput`` plus SGLang's JSON contract check
(``generate_contract_error``) and ``SamplingParams``; the OpenAI routes with
``ChatCompletionRequest`` / ``CompletionRequest``. A failure answers 400 in SGLang's shapes
and is recorded (``GET /_standin/requests``). The stand-in is stricter than SGLang in one way,
on purpose: a top-level field SGLang would silently ignore (not a field of its request model)
is refused too, because for a test it means a field was dropped on the way. Replies are built
with SGLang's response models (``ChatCompletionResponse``, ``ChatCompletionStreamResponse``,
``CompletionResponse``, ``CompletionStreamResponse``, ``ErrorResponse``), serialized as SGLang
does (``model_dump`` / ``model_dump_json``).

It serves the tokenizer and chat template of ``--model-path`` (through ``transformers``, as
SGLang does), behaves like a hybrid reasoning model launched with a reasoning parser (it
thinks when ``chat_template_kwargs`` ask for thinking, as ``reasoning_effort`` sets them) and
with a tool-call parser, and loads the ``--lora`` adapters named.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
import warnings
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from pydantic import TypeAdapter, ValidationError

from tests.support.sglang_shim import stub_vision_modules
from tests.support.standin_http import (
    RECORDER,
    PageCache,
    base_args,
    image_digest,
    serve_until_signal,
)
from tests.support.standin_model import Ask, Choice, StandinError, StandinModel

stub_vision_modules()
warnings.simplefilter("ignore")  # SGLang's imports warn about missing CUDA kernels

from sglang.srt.disaggregation import kv_events  # type: ignore[import-untyped]  # noqa: E402
from sglang.srt.entrypoints.api_contract import generate_contract_error  # type: ignore[import-untyped]  # noqa: E402
from sglang.srt.entrypoints.openai import protocol as P  # type: ignore[import-untyped]  # noqa: E402
from sglang.srt.managers.io_struct import GenerateReqInput  # type: ignore[import-untyped]  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # type: ignore[import-untyped]  # noqa: E402

SGLANG_VERSION = "0.5.23"
_GENERATE = TypeAdapter(GenerateReqInput)
_GENERATE_FIELDS = {f.name for f in dataclasses.fields(GenerateReqInput)}


def _fields(model: type[Any]) -> set[str]:
    out = set()
    for name, info in model.model_fields.items():
        out.add(info.alias or name)
        out.add(name)
    return out


_CHAT_FIELDS = _fields(P.ChatCompletionRequest) | {"reasoning"}  # read by a validator
_COMPLETION_FIELDS = _fields(P.CompletionRequest)


class Server:
    """The stand-in's state: tokenizer, model, adapters, page cache, KV-event publisher."""

    def __init__(self, args: Any) -> None:
        from transformers import AutoTokenizer

        self.args = args
        self.name = args.served_model_name
        self.tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        self.model = StandinModel(self.tokenizer)
        self.adapters = set(args.lora)
        self.cache = PageCache(args.page_size)
        self.max_model_len = 8192
        self.publisher = kv_events.ZmqEventPublisher(
            0,
            endpoint="tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*",
            bind=True,
            buffer_steps=10_000,
            topic="kv",
        )
        self.session: aiohttp.ClientSession | None = None

    # --- shared steps ---------------------------------------------------------------------

    def admit(self, ids: list[int], lora: str | None) -> int:
        """Cached tokens of ``ids``; new full pages are published as SGLang's BlockStored."""
        cached, pages = self.cache.admit(ids)
        if pages:
            events = [
                kv_events.BlockStored(
                    block_hashes=[page],
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=self.args.page_size,
                    lora_id=None,
                    medium="GPU",
                    lora_name=lora,
                )
                for page, parent, tokens in pages
            ]
            self.publisher.publish(kv_events.KVEventBatch(ts=time.time(), events=events))
        return cached

    def adapter(self, model: str, lora_path: Any) -> str | None:
        """SGLang's ``_resolve_lora_path``: ``<served>:<adapter>`` wins over ``lora_path``."""
        name: Any = None
        if ":" in model and model != self.name:
            if model.startswith(f"{self.name}:"):
                name = model[len(self.name) + 1 :].strip() or None
            else:
                name = model.split(":", 1)[1].strip() or None
        if name is None:
            name = lora_path
        if name is None:
            return None
        if not isinstance(name, str) or name not in self.adapters:
            raise StandinError(
                f"The following requested LoRA adapters are not loaded: {name}\n"
                f"Loaded adapters: {sorted(self.adapters)}."
            )
        return name

    def server_info(self) -> dict[str, Any]:
        pub = str(self.publisher._local_pub_endpoint)
        replay = str(self.publisher._local_replay_endpoint)
        return {
            "model_path": self.args.model_path,
            "tokenizer_path": self.args.model_path,
            "served_model_name": self.name,
            "page_size": self.args.page_size,
            "max_total_num_tokens": 65536,
            "max_req_input_len": self.max_model_len - 1,
            "dp_size": 1,
            "tp_size": 1,
            "reasoning_parser": "deepseek-r1",
            "tool_call_parser": "llama3",
            "lora_paths": sorted(self.adapters),
            "incremental_streaming_output": False,
            "kv_events_config": orjson.dumps({"publisher": "zmq", "endpoint": pub,
                                              "replay_endpoint": replay,
                                              "topic": "kv"}).decode(),
            "kv_events": {
                "publisher": "zmq",
                "endpoint_host": "127.0.0.1",
                "endpoint_port_base": int(pub.rsplit(":", 1)[1]),
                "topic": "kv",
                "block_size": self.args.page_size,
                "dp_size": 1,
                "replay_endpoint_port_base": int(replay.rsplit(":", 1)[1]),
            },
            "version": SGLANG_VERSION,
            "frontend": "python",
        }


SERVER = web.AppKey("server", Server)


def _error(message: str, status: int = 400, err_type: str = "BadRequestError") -> web.Response:
    body = P.ErrorResponse(message=message, type=err_type, code=status).model_dump()
    return web.json_response(body, status=status, dumps=lambda o: orjson.dumps(o).decode())


def _validation_error(exc: ValidationError) -> web.Response:
    """SGLang's ``validation_exception_handler``: 400, ``ErrorResponse``, "Bad Request"."""
    return _error(f"{exc} {exc.errors()}", 400, "Bad Request")


async def _body(request: web.Request) -> tuple[Any, Any]:
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = raw.decode("utf-8", "replace")
    return body, request.app[RECORDER].add(request, body)


def _refuse(record: Any, response: web.Response, why: str) -> web.Response:
    record.valid, record.error = False, why
    return response


def _unknown(body: dict[str, Any], known: set[str]) -> list[str]:
    return sorted(set(body) - known)


def _penalized(presence: Any, frequency: Any, repetition: Any) -> bool:
    return bool(presence) or bool(frequency) or repetition not in (None, 1.0)


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


# --- /generate -----------------------------------------------------------------------------


async def generate(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER]
    body, record = await _body(request)
    try:
        obj = _GENERATE.validate_python(body)
    except ValidationError as exc:
        return _refuse(record, _validation_error(exc), str(exc))
    contract = generate_contract_error(body)
    if contract is not None:
        return _refuse(record, web.json_response({"error": contract}, status=400), contract)
    unknown = _unknown(body, _GENERATE_FIELDS)
    if unknown:
        why = f"stand-in: /generate fields SGLang would ignore: {unknown}"
        return _refuse(record, web.json_response({"error": {"message": why}}, status=400), why)
    try:
        obj.normalize_batch_and_arguments()
        if not obj.is_single:
            raise StandinError("stand-in: batched /generate is not modelled")
        raw_sp = dict(obj.sampling_params or {})
        params = SamplingParams(**raw_sp)
        params.verify(len(server.tokenizer))
        if params.n != 1:
            raise StandinError("stand-in: n > 1 on /generate is not modelled")
        lora = server.adapter("", obj.lora_path)
        ids = list(obj.input_ids or server.tokenizer.encode(obj.text))
        schema = raw_sp.get("json_schema")
        ask = Ask(
            prompt_ids=ids,
            max_tokens=params.max_new_tokens if params.max_new_tokens is not None else 128,
            stop=_stops(raw_sp.get("stop")),
            stop_token_ids=tuple(raw_sp.get("stop_token_ids") or ()),
            min_tokens=params.min_new_tokens,
            ignore_eos=params.ignore_eos,
            seed=raw_sp.get("sampling_seed"),
            penalized=_penalized(params.presence_penalty, params.frequency_penalty,
                                 params.repetition_penalty),
            json_schema=None if schema is None else orjson.loads(schema),
            regex=params.regex,
            ebnf=params.ebnf,
            lora=lora,
            top_logprobs=(obj.top_logprobs_num or 0) if obj.return_logprob else None,
        )
        (choice,) = server.model.answer(ask)
    except (StandinError, ValueError, TypeError) as exc:
        return web.json_response({"error": {"message": str(exc)}}, status=400)
    cached = server.admit(ids, lora)
    rid = obj.rid if isinstance(obj.rid, str) else uuid.uuid4().hex

    def meta(done: bool, count: int) -> dict[str, Any]:
        finish: dict[str, Any] | None = None
        if done:
            finish = (
                {"type": "length", "length": count}
                if choice.finish_reason == "length"
                else {"type": "stop", "matched": choice.matched_stop}
            )
        out: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": count,
            "cached_tokens": cached,
            "weight_version": "default",
        }
        if ask.top_logprobs is not None and choice.logprobs is not None:
            out["output_token_logprobs"] = [
                [lp, tid, None] for (_, lp, _), tid in zip(choice.logprobs, choice.ids,
                                                           strict=False)
            ]
        return out

    if not obj.stream:
        return web.json_response(
            {"text": choice.text, "output_ids": choice.ids, "meta_info": meta(True,
                                                                              len(choice.ids))},
            dumps=lambda o: orjson.dumps(o).decode(),
        )
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    text = ""
    steps = max(1, len(choice.deltas))
    for i, delta in enumerate(choice.deltas or [""]):
        text += delta
        count = len(choice.ids) if i == steps - 1 else min(i + 1, len(choice.ids))
        out = {"text": text, "output_ids": choice.ids[:count],
               "meta_info": meta(i == steps - 1, count)}
        await resp.write(b"data: " + orjson.dumps(out) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


# --- the OpenAI routes ---------------------------------------------------------------------


def _thinks(req: Any) -> bool:
    kwargs = req.chat_template_kwargs or {}
    return bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))


def _chat_checks(req: Any) -> None:
    """SGLang's ``OpenAIServingChat._validate_request``, the parts the stand-in models."""
    tools = req.tools or []
    if isinstance(req.tool_choice, str) and req.tool_choice == "required" and not tools:
        raise StandinError("Tools cannot be empty if tool choice is set to required.")
    if not isinstance(req.tool_choice, str):
        if not tools:
            raise StandinError("Tools cannot be empty if tool choice is set to a specific tool.")
        name = req.tool_choice.function.name
        if not any(t.function.name == name for t in tools):
            raise StandinError(f"Tool '{name}' not found in tools list.")


async def _chat_prompt(
    server: Server, req: Any
) -> tuple[list[int], tuple[str, ...], str]:
    """(prompt ids, image digests, last user text) of a chat, its images loaded."""
    assert server.session is not None
    messages: list[dict[str, Any]] = []
    digests: list[str] = []
    last_user = ""
    for message in req.messages:
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, P.ChatCompletionMessageContentImagePart):
                    digests.append(await image_digest(server.session, part.image_url.url))
                    texts.append("<image>")
                elif isinstance(part, P.ChatCompletionMessageContentTextPart):
                    texts.append(part.text)
                else:
                    raise StandinError(f"stand-in: content part {part.type!r} is not modelled")
            content = "".join(texts)
        if message.role == "user":
            last_user = content or ""
        messages.append({"role": message.role, "content": content or ""})
    tools = [t.model_dump(by_alias=True) for t in req.tools] if req.tools else None
    rendered = server.tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False,
        **(req.chat_template_kwargs or {}),
    )
    ids = server.tokenizer.encode(rendered, add_special_tokens=False)
    return list(ids), tuple(digests), last_user


def _format(req: Any) -> Any:
    rf = req.response_format
    if rf is None or getattr(rf, "type", None) not in ("json_schema", "json_object"):
        if rf is not None and getattr(rf, "type", None) not in (None, "text"):
            raise StandinError(f"stand-in: response_format {rf.type!r} is not modelled")
        return None
    if rf.type == "json_object":
        return True
    if rf.json_schema is None:
        raise StandinError("response_format json_schema needs a json_schema")
    return rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {"type": "object"}


def _grammar_error(exc: StandinError, kind: str) -> StandinError:
    return StandinError(f"Failed to compile {kind} grammar: {exc}")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER]
    body, record = await _body(request)
    try:
        req = P.ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        return _refuse(record, _validation_error(exc), str(exc))
    unknown = _unknown(body, _CHAT_FIELDS)
    if unknown:
        why = f"stand-in: chat fields SGLang would ignore: {unknown}"
        return _refuse(record, _error(why), why)
    try:
        if not req.messages:
            raise StandinError("Messages cannot be empty.")
        _chat_checks(req)
        lora = server.adapter(req.model, req.lora_path)
        ids, digests, last_user = await _chat_prompt(server, req)
        tool_choice = (req.tool_choice if isinstance(req.tool_choice, str)
                       else req.tool_choice.function.name)
        ask = Ask(
            prompt_ids=ids,
            max_tokens=body.get("max_completion_tokens") or body.get("max_tokens") or 128,
            stop=_stops(req.stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            seed=req.seed,
            penalized=_penalized(req.presence_penalty, req.frequency_penalty,
                                 req.repetition_penalty),
            n=req.n,
            json_schema=_format(req),
            regex=req.regex,
            ebnf=req.ebnf,
            tools=tuple(t.model_dump(by_alias=True) for t in req.tools or ()),
            tool_choice=tool_choice if req.tools else "none",
            thinking=_thinks(req),
            last_user_text=last_user,
            image_digests=digests,
            lora=lora,
            top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        )
        try:
            choices = server.model.answer(ask)
        except StandinError as exc:
            kind = "json_schema" if ask.json_schema is not None else "structural_tag"
            if str(exc).startswith("Tool "):
                raise
            raise _grammar_error(exc, kind) from exc
    except StandinError as exc:
        return _error(str(exc))
    cached = server.admit(ids, lora)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    usage = _usage(ids, choices, cached)
    if not req.stream:
        response = P.ChatCompletionResponse(
            id=rid, model=req.model, usage=usage,
            choices=[_chat_choice(c, req) for c in choices],
        )
        return web.json_response(response.model_dump(), dumps=lambda o: orjson.dumps(o).decode())
    return await _chat_stream(request, req, rid, choices, usage)


def _usage(ids: list[int], choices: list[Choice], cached: int) -> Any:
    completion = sum(len(c.ids) for c in choices)
    return P.UsageInfo(
        prompt_tokens=len(ids),
        completion_tokens=completion,
        total_tokens=len(ids) + completion,
        prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached),
    )


def _split_reasoning(choice: Choice, req: Any) -> tuple[str | None, str | None]:
    """(reasoning_content, content) as the reasoning parser leaves them."""
    content = choice.text or None
    if choice.reasoning is None:
        return None, content
    if req.separate_reasoning:
        return choice.reasoning, content
    return None, f"<think>{choice.reasoning}</think>{choice.text}"


def _tool_calls(choice: Choice) -> list[Any] | None:
    if not choice.tool_calls:
        return None
    return [
        P.ToolCall(id=t.id, index=i, function=P.FunctionResponse(name=t.name,
                                                                 arguments=t.arguments))
        for i, t in enumerate(choice.tool_calls)
    ]


def _chat_logprobs(entries: list[Any] | None) -> Any:
    if entries is None:
        return None
    return P.ChoiceLogprobs(content=[
        P.ChatCompletionTokenLogprob(
            token=text, bytes=list(text.encode()), logprob=lp,
            top_logprobs=[P.TopLogprob(token=t, bytes=list(t.encode()), logprob=v)
                          for t, v in top],
        )
        for text, lp, top in entries
    ])


def _chat_choice(choice: Choice, req: Any) -> Any:
    reasoning, content = _split_reasoning(choice, req)
    return P.ChatCompletionResponseChoice(
        index=choice.index,
        message=P.ChatMessage(role="assistant", content=content, reasoning_content=reasoning,
                              tool_calls=_tool_calls(choice)),
        logprobs=_chat_logprobs(choice.logprobs),
        finish_reason=choice.finish_reason,
        matched_stop=choice.matched_stop,
    )


async def _chat_stream(
    request: web.Request, req: Any, rid: str, choices: list[Choice], usage: Any
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    created = int(time.time())

    async def send(index: int, delta: Any, **extra: Any) -> None:
        chunk = P.ChatCompletionStreamResponse(
            id=rid, created=created, model=req.model,
            choices=[P.ChatCompletionResponseStreamChoice(index=index, delta=delta, **extra)],
        )
        await resp.write(f"data: {chunk.model_dump_json()}\n\n".encode())

    for choice in choices:
        i = choice.index
        await send(i, P.DeltaMessage(role="assistant", content=""))
        reasoning, _ = _split_reasoning(choice, req)
        if reasoning is not None:
            await send(i, P.DeltaMessage(reasoning_content=reasoning))
        elif choice.reasoning is not None:  # not separated: it leads the content
            await send(i, P.DeltaMessage(content=f"<think>{choice.reasoning}</think>"))
        entries = choice.logprobs
        aligned = entries is not None and len(entries) == len(choice.deltas)
        for k, delta in enumerate(choice.deltas):
            logprobs = None
            if entries is not None and (aligned or k == 0):
                logprobs = _chat_logprobs([entries[k]] if aligned else entries)
            await send(i, P.DeltaMessage(content=delta), logprobs=logprobs)
        for k, call in enumerate(choice.tool_calls):
            head = P.ToolCall(id=call.id, index=k,
                              function=P.FunctionResponse(name=call.name, arguments=""))
            await send(i, P.DeltaMessage(tool_calls=[head]))
            args = P.ToolCall(index=k, function=P.FunctionResponse(arguments=call.arguments))
            await send(i, P.DeltaMessage(tool_calls=[args]))
        await send(i, P.DeltaMessage(), finish_reason=choice.finish_reason,
                   matched_stop=choice.matched_stop)
    if (req.stream_options is not None) and req.stream_options.include_usage:
        chunk = P.ChatCompletionStreamResponse(id=rid, created=created, model=req.model,
                                               choices=[], usage=usage)
        await resp.write(f"data: {chunk.model_dump_json()}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _completion_logprobs(entries: list[Any] | None) -> Any:
    if entries is None:
        return None
    offsets, at = [], 0
    for text, _, _ in entries:
        offsets.append(at)
        at += len(text)
    return P.LogProbs(
        text_offset=offsets,
        token_logprobs=[lp for _, lp, _ in entries],
        tokens=[text for text, _, _ in entries],
        top_logprobs=[dict(top) for _, _, top in entries],
    )


async def completions(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER]
    body, record = await _body(request)
    try:
        req = P.CompletionRequest.model_validate(body)
    except ValidationError as exc:
        return _refuse(record, _validation_error(exc), str(exc))
    unknown = _unknown(body, _COMPLETION_FIELDS)
    if unknown:
        why = f"stand-in: completion fields SGLang would ignore: {unknown}"
        return _refuse(record, _error(why), why)
    try:
        lora = server.adapter(req.model, req.lora_path)
        prompt = req.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = list(server.tokenizer.encode(prompt))
        elif prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise StandinError("stand-in: a batch of prompts is not modelled")
        ask = Ask(
            prompt_ids=ids,
            max_tokens=req.max_tokens,
            stop=_stops(req.stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            seed=req.seed,
            penalized=_penalized(req.presence_penalty, req.frequency_penalty,
                                 req.repetition_penalty),
            n=req.n,
            json_schema=(orjson.loads(req.json_schema) if req.json_schema is not None
                         else _format(req)),
            regex=req.regex,
            ebnf=req.ebnf,
            lora=lora,
            top_logprobs=req.logprobs,
        )
        try:
            choices = server.model.answer(ask)
        except StandinError as exc:
            raise _grammar_error(exc, "json_schema") from exc
    except (StandinError, orjson.JSONDecodeError) as exc:
        return _error(str(exc))
    cached = server.admit(ids, lora)
    rid = f"cmpl-{uuid.uuid4().hex}"
    usage = _usage(ids, choices, cached)
    if not req.stream:
        response = P.CompletionResponse(
            id=rid, model=req.model, usage=usage,
            choices=[
                P.CompletionResponseChoice(
                    index=c.index, text=c.text, logprobs=_completion_logprobs(c.logprobs),
                    finish_reason=c.finish_reason, matched_stop=c.matched_stop,
                )
                for c in choices
            ],
        )
        return web.json_response(response.model_dump(), dumps=lambda o: orjson.dumps(o).decode())
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    created = int(time.time())

    async def send(choice: Any, chunk_usage: Any = None) -> None:
        chunk = P.CompletionStreamResponse(id=rid, created=created, model=req.model,
                                           choices=[choice] if choice else [], usage=chunk_usage)
        await resp.write(f"data: {chunk.model_dump_json()}\n\n".encode())

    for c in choices:
        entries = c.logprobs
        aligned = entries is not None and len(entries) == len(c.deltas)
        for k, delta in enumerate(c.deltas):
            logprobs = None
            if entries is not None and (aligned or k == 0):
                logprobs = _completion_logprobs([entries[k]] if aligned else entries)
            await send(P.CompletionResponseStreamChoice(index=c.index, text=delta,
                                                        logprobs=logprobs))
        await send(P.CompletionResponseStreamChoice(
            index=c.index, text="", finish_reason=c.finish_reason, matched_stop=c.matched_stop))
    if req.stream_options is not None and req.stream_options.include_usage:
        await send(None, usage)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


# --- the small routes ----------------------------------------------------------------------


async def tokenize(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    body, record = await _body(request)
    try:
        req = P.TokenizeRequest.model_validate(body)
    except ValidationError as exc:
        return _refuse(record, _validation_error(exc), str(exc))
    try:
        if req.messages is not None:
            ids, _, _ = await _chat_prompt(server, req.to_chat_completion_request())
        else:
            prompt = req.prompt if isinstance(req.prompt, str) else "".join(req.prompt or [])
            ids = list(server.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens))
    except StandinError as exc:
        return _error(str(exc))
    out = P.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=server.max_model_len)
    return web.json_response(out.model_dump())


async def models(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    cards = [P.ModelCard(id=server.name, root=server.name, max_model_len=server.max_model_len)]
    cards += [P.ModelCard(id=f"{server.name}:{a}", root=server.name, parent=server.name)
              for a in sorted(server.adapters)]
    return web.json_response(P.ModelList(data=cards).model_dump())


async def server_info(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVER].server_info())


async def _main() -> None:
    args = base_args("sglang_standin", "A test-only SGLang 0.5.23 stand-in.").parse_args()
    server = Server(args)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[SERVER] = server
    app.router.add_get("/v1/models", models)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_post("/v1/tokenize", tokenize)
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    await serve_until_signal(app, args, server, server.publisher.shutdown)


if __name__ == "__main__":
    asyncio.run(_main())
