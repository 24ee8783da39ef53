"""The request surface, field × streaming × engine: client → gateway → sidecar → engine.

Each field a client can ask SGLang's OpenAI server for is sent through a real stack of each
engine kind (``field_stack``), whole and streamed. A field the engine honours must reach it
(the stand-ins record every body and validate it with the engine's own request models) and
show its effect in a reply of OpenAI's shape (checked against SGLang's response models); a
field the engine cannot honour must come back as the engine's own refusal, relayed in
OpenAI's error shape, never be dropped. ``OUTCOMES`` is the matrix: what each engine does with
each field. Bad input to the new fields gets the engine's error while a plain request in
flight completes.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import itertools
import json
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from tests.integration.stack.field_stack import (
    ADAPTER,
    KINDS,
    EngineStack,
    Reply,
    send,
    start_stack,
)
from tests.support.gateway import routable

pytestmark = pytest.mark.slow

_ids = itertools.count()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "days": {"type": "integer"}},
                       "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


def _png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (2, 2), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


PNG = _png()
PNG_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
PNG_DIGEST = hashlib.sha256(PNG).hexdigest()[:16]


@pytest.fixture(scope="module", params=KINDS)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[EngineStack]:
    """One gateway + sidecar + engine of each kind for the module, stopped after it."""
    s = start_stack(request.param, tmp_path_factory.mktemp(request.param))
    yield s
    s.stop()


@dataclass
class Ctx:
    """What a case needs to prepare its request and check its reply."""

    stack: EngineStack
    session: aiohttp.ClientSession
    stream: bool

    async def plain(self, **fields: Any) -> Reply:
        """A whole chat of the base conversation with ``fields``: a baseline to compare to."""
        body = {**chat_body(), **fields}
        reply = await send(self.session, self.stack.url, body, f"baseline-{next(_ids)}")
        assert reply.status == 200, reply.error
        return reply


def chat_body(text: str = "Tell me about the weather.") -> dict[str, Any]:
    return {"model": "tiny", "messages": [
        {"role": "system", "content": "You are a terse assistant that answers briefly."},
        {"role": "user", "content": text}]}


def completion_body() -> dict[str, Any]:
    return {"model": "tiny", "prompt": "The weather today is"}


Prepare = Callable[[Ctx], Awaitable[dict[str, Any]]]
Check = Callable[[Ctx, dict[str, Any], Reply], Awaitable[None]]
Carried = Callable[[str, dict[str, Any]], bool]


@dataclass(frozen=True)
class Case:
    """One field: the request that carries it, how to see it reached the engine (from the
    engine's path and the body it recorded), and how its effect shows in the reply."""

    name: str
    prepare: Prepare
    carried: Carried
    check: Check


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields of a body, wherever the engine's API keeps them."""
    return {**body, **(body.get("sampling_params") or {})}


def fixed(fields: dict[str, Any]) -> Prepare:
    """A case whose request fields are known in advance."""

    async def prepare(ctx: Ctx) -> dict[str, Any]:
        return fields

    return prepare


# --- the checks of each field's effect ------------------------------------------------------


async def check_tools(ctx: Ctx, body: dict[str, Any], reply: Reply) -> None:
    choice = reply.only
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.tool_calls.values()
    assert call["name"] == "get_weather"
    assert isinstance(json.loads(call["arguments"])["city"], str)


async def check_json_object(ctx: Ctx, body: dict[str, Any], reply: Reply) -> None:
    assert isinstance(json.loads(reply.only.content), dict), reply.only


async def check_json_schema(ctx: Ctx, body: dict[str, Any], reply: Reply) -> None:
    value = json.loads(reply.only.content)
    assert isinstance(value["name"], str) and isinstance(value["age"], int), value


def check_constraint(kind: str, rule: str) -> Check:
    async def check(ctx: Ctx, body: dict[str, Any], reply: Reply) -> None:
        assert f"{kind} {rule!r}" in reply.only.content, reply.only

    return check


async def check_logprobs(ctx: Ctx, body: dict[str, Any], reply: Reply) -> None:
    entries = reply.only.logprobs
    assert len(entries) >= 1, reply.only
    tops = [e["top_logprobs"] for e in entries]
    assert all(len(top) == 2 for top in tops), tops


async def prepare_stop(ctx: Ctx) -> dict[str, Any]:
    base = await ctx.plain(max_tokens=16, temperature=0, ignore_eos=True)
    text = base.only.content
    middle = len(text) // 2
    order = sorted(range(1, len(text)), key=lambda i: abs(i - middle))
    stop = next(text[i] for i in order if text[i].strip() and text[i] != "\ufffd")
    return {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [stop],
            "_expect": text[: text.index(stop)]}


async def check_stop(ctx: Ctx, body: dict[str, Any], reply: Reply) -> None:
    assert reply.only.finish_reason == "stop", reply.only
    assert reply.only.content == body["_expect"]


async def check_stop_token_ids(ctx: Ctx, body: dict[str, Any], reply: Reply) -> None:
    """Every token is a stop token: the first one ends it (else: 8 tokens, ``length``)."""
    assert reply.only.finish_reason == "stop", reply.only
    assert reply.completion_tokens == 1


async def check_n(ctx: Ctx, body: dict[str, Any], reply: Reply) -> None:
    assert sorted(reply.choices) == [0, 1]
    assert all(c.finish_reason for c in reply.choices.values())


SEEDED = {"max_tokens": 12, "temperature": 1.0, "ignore_eos": True}


async def check_seed(ctx: Ctx, body: dict[str, Any], reply: Reply) -> None:
    again = await ctx.plain(**SEEDED, seed=11)
    other = await ctx.plain(**SEEDED, seed=12)
    assert reply.only.content == again.only.content
    assert other.only.content != reply.only.content


PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 1.5, "repetition_penalty": 2.0}
GREEDY = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


async def check_penalties(ctx: Ctx, body: dict[str, Any], reply: Reply) -> None:
    unpenalized = await ctx.plain(**GREEDY)
    assert reply.only.content != unpenalized.only.content


def check_runs_to(tokens: int) -> Check:
    async def check(ctx: Ctx, body: dict[str, Any], reply: Reply) -> None:
        assert reply.only.finish_reason == "length", reply.only
        assert reply.completion_tokens == tokens
        if ctx.stack.kind != "refengine":  # the stand-ins' model stops at EOS after 8
            natural = await ctx.plain(max_tokens=tokens)
            assert natural.only.finish_reason == "stop"
            assert natural.completion_tokens < tokens

    return check


async def check_reasoning(ctx: Ctx, body: dict[str, Any], reply: Reply) -> None:
    assert "Tell me about the weather." in reply.only.reasoning, reply.only
    assert reply.only.content


async def check_thinking(ctx: Ctx, body: dict[str, Any], reply: Reply) -> None:
    """A chat that asks the template for thinking: an engine with a reasoning parser (the
    SGLang stand-in's /server_info names one) must get it on its OpenAI server, where the
    parser splits the thinking out; the others know of no parser and answer plainly."""
    if ctx.stack.kind == "sglang":
        assert "Tell me about the weather." in (reply.only.reasoning or ""), reply.only
    else:
        assert not reply.only.reasoning, reply.only
    assert reply.only.content


async def check_image(ctx: Ctx, body: dict[str, Any], reply: Reply) -> None:
    assert f"[image sha256:{PNG_DIGEST}]" in reply.only.content, reply.only


async def check_lora(ctx: Ctx, body: dict[str, Any], reply: Reply) -> None:
    assert reply.only.content.startswith(f"[lora {ADAPTER}]"), reply.only


def image_chat() -> dict[str, Any]:
    body = chat_body()
    body["messages"][1]["content"] = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": PNG_URL}}]
    return body


CASES = [
    Case("tools", fixed({"tools": [TIME, WEATHER],
                         "tool_choice": {"type": "function",
                                         "function": {"name": "get_weather"}}}),
         lambda path, b: len(b.get("tools") or []) == 2 and "tool_choice" in b, check_tools),
    Case("json_object", fixed({"response_format": {"type": "json_object"}}),
         lambda path, b: (b.get("response_format") or {}).get("type") == "json_object",
         check_json_object),
    Case("json_schema", fixed({"response_format": {
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}),
         lambda path, b: (b.get("response_format") or {}).get("json_schema", {}).get(
             "schema") == SCHEMA, check_json_schema),
    Case("regex", fixed({"regex": "(sunny|rainy)"}),
         lambda path, b: b.get("regex") == "(sunny|rainy)",
         check_constraint("regex", "(sunny|rainy)")),
    Case("ebnf", fixed({"ebnf": 'root ::= "sunny" | "rainy"'}),
         lambda path, b: b.get("ebnf") == 'root ::= "sunny" | "rainy"',
         check_constraint("ebnf", 'root ::= "sunny" | "rainy"')),
    Case("logprobs", fixed({"max_tokens": 6, "logprobs": True, "top_logprobs": 2}),
         lambda path, b: b.get("logprobs") is True and b.get("top_logprobs") == 2,
         check_logprobs),
    Case("completion_logprobs", fixed({**completion_body(), "max_tokens": 6, "logprobs": 2}),
         lambda path, b: b.get("logprobs") == 2, check_logprobs),
    Case("stop", prepare_stop,
         lambda path, b: len(_sampling(b).get("stop") or []) == 1, check_stop),
    Case("stop_token_ids", fixed({"max_tokens": 8, "ignore_eos": True,
                                  "stop_token_ids": list(range(1024))}),
         lambda path, b: len(_sampling(b).get("stop_token_ids") or []) == 1024,
         check_stop_token_ids),
    Case("completion_stop_token_ids", fixed({**completion_body(), "max_tokens": 8,
                                             "ignore_eos": True,
                                             "stop_token_ids": list(range(1024))}),
         lambda path, b: len(_sampling(b).get("stop_token_ids") or []) == 1024,
         check_stop_token_ids),
    Case("n", fixed({"n": 2, "max_tokens": 6}), lambda path, b: b.get("n") == 2, check_n),
    Case("seed", fixed({**SEEDED, "seed": 11}),
         lambda path, b: 11 in (_sampling(b).get("seed"), _sampling(b).get("sampling_seed")),
         check_seed),
    Case("penalties", fixed({**GREEDY, **PENALTIES}),
         lambda path, b: all(_sampling(b).get(k) == v for k, v in PENALTIES.items()),
         check_penalties),
    Case("min_tokens", fixed({"max_tokens": 12, "min_tokens": 12}),
         lambda path, b: 12 in (b.get("min_tokens"), _sampling(b).get("min_new_tokens")),
         check_runs_to(12)),
    Case("ignore_eos", fixed({"max_tokens": 12, "ignore_eos": True}),
         lambda path, b: _sampling(b).get("ignore_eos") is True, check_runs_to(12)),
    Case("reasoning", fixed({"reasoning_effort": "high", "max_tokens": 6}),
         lambda path, b: b.get("reasoning_effort") == "high", check_reasoning),
    Case("thinking", fixed({"chat_template_kwargs": {"enable_thinking": True}, "max_tokens": 6}),
         lambda path, b: path in ("/generate", "/v1/completions")  # the gateway's template
         or (b.get("chat_template_kwargs") or {}).get("enable_thinking") is True,
         check_thinking),
    Case("image", fixed({**image_chat(), "max_tokens": 6}),
         lambda path, b: PNG_URL in json.dumps(b.get("messages")), check_image),
    Case("lora", fixed({"model": f"tiny:{ADAPTER}", "max_tokens": 6}),
         lambda path, b: ADAPTER in (b.get("lora_path"), (b.get("lora_request") or {}).get(
             "lora_name"), (b.get("model") or "").partition(":")[2]), check_lora),
]

# What each engine does with each field: honoured, or refused with (a part of) its message.
OUTCOMES: dict[str, dict[str, str]] = {
    "refengine": {
        "tools": "tools are not supported by the reference engine",
        "json_object": "response_format 'json_object' is not supported",
        "json_schema": "response_format 'json_schema' is not supported",
        "regex": "regex is not supported by the reference engine",
        "ebnf": "ebnf is not supported by the reference engine",
        "logprobs": "logprobs are not supported by the reference engine",
        "completion_logprobs": "logprobs are not supported by the reference engine",
        "reasoning": "reasoning is not supported by the reference engine",
        "image": "only text content parts are supported",
        "lora": "LoRA adapters are not supported by the reference engine",
    },
    "sglang": {},
    "trtllm": {
        # SGLang's own extras: trtllm-serve forbids fields its models do not name
        "regex": "Extra inputs are not permitted",
        "ebnf": "Extra inputs are not permitted",
    },
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
async def test_field(stack: EngineStack, session: aiohttp.ClientSession, case: Case,
                     stream: bool) -> None:
    """The field reaches the engine and its effect shows in an OpenAI-shaped reply, or the
    engine's refusal comes back in OpenAI's error shape; never a silent drop."""
    await routable(session, stack.url, 1)
    ctx = Ctx(stack, session, stream)
    fields = await case.prepare(ctx)
    body = {**chat_body(), **{k: v for k, v in fields.items() if not k.startswith("_")},
            "stream": stream}
    if "prompt" in body:
        del body["messages"]
    if stream:
        body["stream_options"] = {"include_usage": True}
    request_id = f"matrix-{stack.kind}-{case.name}-{next(_ids)}"
    reply = await send(session, stack.url, body, request_id)
    assert reply.headers["x-kvsidecar-worker"] == f"{stack.kind}-0"
    refusal = OUTCOMES[stack.kind].get(case.name)
    records = await stack.records(session, request_id) if stack.records_bodies else []
    if stack.records_bodies:
        assert records, f"nothing reached the {stack.kind} engine"
        assert all(case.carried(r["path"], r["body"]) for r in records), records
        for r in records:  # the engine's OpenAI server got the client's body, unchanged
            if "messages" in r["body"] or isinstance(r["body"].get("prompt"), str):
                assert {k: r["body"].get(k) for k in body} == body, r["body"]
    if refusal is not None:
        assert reply.status == 400, (reply.status, reply.error)
        assert reply.error is not None and refusal in reply.error["message"], reply.error
        assert reply.error["type"] == "invalid_request_error"
        return
    assert reply.status == 200, reply.error
    assert all(r["valid"] for r in records), [r["error"] for r in records]
    await case.check(ctx, fields, reply)


# --- bad input to the new fields ------------------------------------------------------------


def bad_inputs(stack: EngineStack) -> dict[str, dict[str, Any]]:
    """Per field, a request the engine must refuse."""
    return {
        "malformed_json_schema": {"response_format": {"type": "json_schema", "json_schema": {
            "name": "broken", "schema": {"type": "object",
                                         "properties": {"a": {"type": "strng"}}}}}},
        "unknown_tool_choice": {"tools": [WEATHER], "tool_choice": {
            "type": "function", "function": {"name": "no_such_tool"}}},
        "unfetchable_image": {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url",
             "image_url": {"url": f"{stack.engine_url}/no/such/image.png"}}]}]},
        "unknown_lora": {"model": "tiny:no-such-adapter"},
    }


# What each engine says about each bad input.
BAD_OUTCOMES: dict[str, dict[str, str]] = {
    "refengine": {
        "malformed_json_schema": "response_format 'json_schema' is not supported",
        "unknown_tool_choice": "tools are not supported",
        "unfetchable_image": "only text content parts are supported",
        "unknown_lora": "LoRA adapters are not supported",
    },
    "sglang": {
        "malformed_json_schema": "Failed to compile json_schema grammar",
        "unknown_tool_choice": "Tool 'no_such_tool' not found in tools list.",
        "unfetchable_image": "Failed to load image",
        "unknown_lora": "The following requested LoRA adapters are not loaded: no-such-adapter",
    },
    "trtllm": {
        "malformed_json_schema": "unknown JSON schema type 'strng'",
        "unknown_tool_choice": "Tool 'no_such_tool' not found in tools list.",
        "unfetchable_image": "Failed to load image",
        # trtllm-serve names adapters by id: the sidecar refuses one it was not told about
        "unknown_lora": "LoRA adapter 'no-such-adapter' is not one this sidecar knows",
    },
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_bad_input_gets_the_engines_error_and_spares_the_rest(
    stack: EngineStack, session: aiohttp.ClientSession, stream: bool
) -> None:
    """Each bad input comes back as the engine's error in OpenAI's shape, while a plain
    streamed request in flight through the same stack completes normally."""
    await routable(session, stack.url, 1)
    long = {**chat_body("Keep talking."), "max_tokens": 48, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(f"{stack.url}/v1/chat/completions", json=long) as plain:
        assert plain.status == 200
        first = await plain.content.readline()
        assert first.startswith(b"data:"), first
        bad = bad_inputs(stack)
        replies = await asyncio.gather(*(
            send(session, stack.url, {**chat_body(), **fields, "stream": stream},
                 f"bad-{stack.kind}-{name}-{next(_ids)}")
            for name, fields in bad.items()))
        events = [first.strip()] + [
            line.strip() async for line in plain.content if line.startswith(b"data:")]
    for (name, _), reply in zip(bad.items(), replies, strict=True):
        assert reply.status == 400, (name, reply.status, reply.error)
        assert reply.error is not None
        assert BAD_OUTCOMES[stack.kind][name] in reply.error["message"], (name, reply.error)
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[5:]) for e in events[:-1]]
    usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
    assert usage["completion_tokens"] == 48
    finish = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finish == ["length"]


async def test_the_engine_refused_only_what_the_matrix_says(
    stack: EngineStack, session: aiohttp.ClientSession
) -> None:
    """Every body a stand-in received (the sidecar's own calls included: discovery, the
    tokenization canary) passed the engine's validation, except the requests the matrix
    expects it to refuse."""
    if not stack.records_bodies:
        assert stack.kind == "refengine"
        return
    async with session.get(f"{stack.engine_url}/_standin/requests") as resp:
        records = await resp.json()
    assert records
    refused = {f"matrix-{stack.kind}-{name}-" for name in OUTCOMES[stack.kind]}
    refused |= {f"bad-{stack.kind}-"}
    for record in records:
        if not record["valid"]:
            rid = record["request_id"] or ""
            assert any(rid.startswith(prefix) for prefix in refused), record


def test_the_matrix_names_only_known_fields() -> None:
    """Every refusal in the matrix belongs to a case and an engine kind that exist."""
    names = {c.name for c in CASES}
    assert set(OUTCOMES) == set(KINDS) == set(BAD_OUTCOMES)
    for outcomes in OUTCOMES.values():
        assert set(outcomes) <= names
