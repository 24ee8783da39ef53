"""Which path a request takes to a sidecar: token ids, or the client's body for the engine's
own OpenAI server; nothing the client asked for is dropped."""

from __future__ import annotations

import msgspec
import orjson
import pytest

from kvcore.requests import TokenizedRequest
from routing.pipeline.sidecar_body import takes_token_path, tokenized_body
from routing.prompt.openai_api import Endpoint, parse_request


def chat(**fields: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"temperature": 0.5, "top_p": 0.9, "seed": 7, "max_tokens": 8, "stream": True,
         "stream_options": {"include_usage": True}, "stop": ["\n"], "stop_token_ids": [2],
         "ignore_eos": True, "min_tokens": 8, "n": 1, "presence_penalty": 0.1,
         "cache_salt": "t"},
        {"chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": True},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    ],
)
def test_plain_sampling_takes_the_token_path(fields: dict[str, object]) -> None:
    """Sampling parameters and what the gateway consumes itself go as token ids."""
    assert takes_token_path(parse_request(Endpoint.CHAT, chat(**fields)))


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
         "tool_choice": "auto"},
        {"response_format": {"type": "json_object"}},
        {"logprobs": True, "top_logprobs": 2},
        {"n": 2},
        {"regex": "[a-z]+"},
        {"user": "someone"},
        {"stop": 5},
        {"ignore_eos": "yes"},
        {"min_tokens": 2.5},
        {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
    ],
)
def test_anything_else_goes_with_the_clients_body(fields: dict[str, object]) -> None:
    """A field the token path does not carry, or a value it does not expect, sends the body."""
    req = parse_request(Endpoint.CHAT, chat(**fields))
    assert not takes_token_path(req)
    sent = msgspec.json.decode(
        tokenized_body(req, [1, 2, 3], "rid", None, token_path=False), type=TokenizedRequest
    )
    assert sent.openai is not None and sent.openai.path == "/v1/chat/completions"
    assert sent.openai.body == orjson.loads(chat(**fields))
    assert sent.prompt_token_ids == [1, 2, 3]  # still what the gateway hashed


def test_the_token_path_carries_no_body() -> None:
    """A plain request is token ids only."""
    req = parse_request(Endpoint.COMPLETIONS, b'{"model":"m","prompt":"hi","max_tokens":3}')
    sent = msgspec.json.decode(tokenized_body(req, [1, 2], "rid", 0), type=TokenizedRequest)
    assert sent.openai is None and sent.max_tokens == 3 and sent.dp_rank == 0


def test_min_tokens_rides_the_token_path() -> None:
    """min_tokens is a sampling parameter the token path carries: no client body, and the
    value reaches the sidecar."""
    req = parse_request(Endpoint.CHAT, chat(max_tokens=8, min_tokens=8, ignore_eos=True))
    assert takes_token_path(req)
    sent = msgspec.json.decode(tokenized_body(req, [1, 2], "rid", None), type=TokenizedRequest)
    assert sent.openai is None and sent.min_tokens == 8 and sent.ignore_eos
