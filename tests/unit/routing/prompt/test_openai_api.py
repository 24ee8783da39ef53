"""OpenAI request parsing: what passes, and the 400s for everything malformed."""

from __future__ import annotations

import typing

import orjson
import pytest

from kvcore.errors import OpenAIError
from kvcore.requests import EngineOpenAI
from routing.prompt.openai_api import Endpoint, parse_request

CHAT = Endpoint.CHAT
CMPL = Endpoint.COMPLETIONS


def body(**fields: object) -> bytes:
    return orjson.dumps(fields)


def test_chat_request_parsed() -> None:
    """A chat request's model, stream flags, limits and messages are picked out."""
    raw = body(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
        max_completion_tokens=7,
        cache_salt="tenant-a",
        some_engine_extension={"kept": True},
    )
    req = parse_request(CHAT, raw)
    assert (req.model, req.stream, req.include_usage, req.max_tokens) == ("m", True, True, 7)
    assert req.messages == [{"role": "user", "content": "hi"}]
    assert req.cache_salt == "tenant-a"
    assert req.body["some_engine_extension"] == {"kept": True}


@pytest.mark.parametrize(
    ("prompt", "text", "ids"),
    [
        ("hello", "hello", None),
        (["hello"], "hello", None),
        ([1, 2, 3], None, [1, 2, 3]),
        ([[4, 5]], None, [4, 5]),
        (["a", "b"], None, None),
    ],
)
def test_completion_prompt_shapes(prompt: object, text: str | None, ids: list[int] | None) -> None:
    """Every prompt shape OpenAI allows is accepted; one prompt is unwrapped."""
    req = parse_request(CMPL, body(model="m", prompt=prompt))
    assert (req.prompt_text, req.prompt_ids) == (text, ids)


BAD = [
    (CHAT, b"", "empty"),
    (CHAT, b"{not json", "not valid JSON"),
    (CHAT, b"[1, 2]", "must be a JSON object"),
    (CHAT, body(messages=[{"role": "user", "content": "x"}]), "'model' is required"),
    (CHAT, body(model="m"), "'messages' is required"),
    (CHAT, body(model="m", messages=[]), "'messages' is required"),
    (CHAT, body(model="m", messages=["hi"]), "messages[0] must be an object"),
    (CHAT, body(model="m", messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (CHAT, body(model="m", messages=[{"role": "user"}]), "content is required"),
    (CHAT, body(model="m", messages=[{"role": "user", "content": 3}]), "content must be"),
    (CMPL, body(model="m"), "'prompt' must be"),
    (CMPL, body(model="m", prompt=[1, -2]), "integers >= 0"),
    (CMPL, body(model="m", prompt={"a": 1}), "'prompt' must be"),
    (CMPL, body(model="m", prompt="x", stream="yes"), "'stream' must be a boolean"),
    (CMPL, body(model="m", prompt="x", stream_options={"include_usage": True}), "only allowed"),
    (CMPL, body(model="m", prompt="x", max_tokens=0), "'max_tokens' must be an integer >= 1"),
    (CMPL, body(model="m", prompt="x", max_tokens=2.5), "'max_tokens'"),
    (CMPL, body(model="m", prompt="x", temperature=3), "'temperature' must be a number"),
    (CMPL, body(model="m", prompt="x", top_p="high"), "'top_p'"),
    (CMPL, body(model="m", prompt="x", n=0), "'n' must be"),
    (CMPL, body(model="m", prompt="x", cache_salt=5), "'cache_salt'"),
]


@pytest.mark.parametrize(("endpoint", "raw", "fragment"), BAD)
def test_malformed_bodies_are_400(endpoint: Endpoint, raw: bytes, fragment: str) -> None:
    """Each malformed body is a 400 whose message says what was wrong."""
    with pytest.raises(OpenAIError) as info:
        parse_request(endpoint, raw)
    assert info.value.status == 400
    assert fragment in info.value.message
    error = orjson.loads(info.value.body())["error"]
    assert error["type"] == "invalid_request_error" and fragment in error["message"]


def test_every_route_the_gateway_serves_is_one_a_sidecar_takes() -> None:
    """The gateway's routes (``Endpoint``) and the paths a sidecar's engine request may name
    (``EngineOpenAI.path``) are two lists: a route missing from the second passes the
    gateway and is refused by every sidecar as an invalid tokenized request."""
    paths = typing.get_args(typing.get_type_hints(EngineOpenAI)["path"])
    assert sorted(paths) == sorted(e.value for e in Endpoint)
