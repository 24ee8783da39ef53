"""OpenAI request parsing and validation, and OpenAI-shaped errors.

The gateway parses only what it needs to place and account a request (model, prompt or
messages, stream flags, token limits) and checks the common sampling parameters; every other
field passes through to the engine untouched.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import orjson

from kvcore.errors import Dialect, OpenAIError

__all__ = ["Endpoint", "OpenAIRequest", "media_parts", "parse_request"]


class Endpoint(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    # Relayed to a worker as they come (its engine's own server answers them), placed by load.
    RESPONSES = "/v1/responses"
    MESSAGES = "/v1/messages"  # Anthropic's shape
    EMBEDDINGS = "/v1/embeddings"
    TOKENIZE = "/v1/tokenize"

    @property
    def prompted(self) -> bool:
        """Whether the gateway reads its prompt (tokenizes, hashes, checks its options)."""
        return self is Endpoint.CHAT or self is Endpoint.COMPLETIONS

    @property
    def dialect(self) -> Dialect:
        """The error shape its clients read: Anthropic's on Anthropic's route."""
        return Dialect.ANTHROPIC if self is Endpoint.MESSAGES else Dialect.OPENAI


def _bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """The parts of a completion or chat request the gateway acts on."""

    endpoint: Endpoint
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    prompt_text: str | None  # completions with one text prompt
    prompt_ids: list[int] | None  # completions with one token-id prompt
    messages: list[dict[str, Any]] | None  # chat
    cache_salt: str | None
    lora_name: str | None = None  # a LoRA adapter named in ``model`` as "<base>:<adapter>"
    prompted: bool = True  # ``endpoint.prompted``, asked once per request


_NUMBER_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}


def parse_request(endpoint: Endpoint, raw: bytes) -> OpenAIRequest:
    """Parse and validate a request body; raises ``OpenAIError`` (400) on anything malformed."""
    if not raw:
        raise _bad("the request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"the request body is not valid JSON: {exc}") from exc
    if type(body) is not dict:
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if type(model) is not str or not model:
        raise _bad("'model' is required and must be a non-empty string", "model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if type(stream) is not bool:
        raise _bad(f"'stream' must be a boolean, got {stream!r}", "stream")
    if not endpoint.prompted:  # the engine validates the rest
        return OpenAIRequest(
            endpoint, body, model, stream, False, None, None, None, None, None, prompted=False
        )
    include_usage = _stream_options(body, stream)
    max_tokens = _max_tokens(body)
    for name, (low, high) in _NUMBER_RANGES.items():
        value = body.get(name)
        if value is not None and (
            type(value) not in (int, float) or not math.isfinite(value) or not low <= value <= high
        ):
            raise _bad(f"'{name}' must be a number in [{low:g}, {high:g}], got {value!r}", name)
    n = body.get("n")
    if n is not None and (type(n) is not int or n < 1):
        raise _bad(f"'n' must be an integer >= 1, got {n!r}", "n")
    salt = body.get("cache_salt")
    if salt is not None and type(salt) is not str:
        raise _bad("'cache_salt' must be a string", "cache_salt")
    prompt_text = prompt_ids = messages = None
    if endpoint is Endpoint.CHAT:
        messages = _messages(body)
    else:
        prompt_text, prompt_ids = _prompt(body)
    return OpenAIRequest(
        endpoint,
        body,
        model,
        stream,
        include_usage,
        max_tokens,
        prompt_text,
        prompt_ids,
        messages,
        salt or None,
    )


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if type(options) is not dict:
        raise _bad("'stream_options' must be an object", "stream_options")
    if not stream:
        raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include = options.get("include_usage", False)
    if type(include) is not bool:
        raise _bad("'stream_options.include_usage' must be a boolean", "stream_options")
    return include


def _max_tokens(body: dict[str, Any]) -> int | None:
    value = None
    for name in ("max_completion_tokens", "max_tokens"):
        given = body.get(name)
        if given is None:
            continue
        if type(given) is not int or given < 1:
            raise _bad(f"'{name}' must be an integer >= 1, got {given!r}", name)
        value = given if value is None else value
    return value


def _prompt(body: dict[str, Any]) -> tuple[str | None, list[int] | None]:
    prompt = body.get("prompt")
    if type(prompt) is str:
        return prompt, None
    if type(prompt) is list and prompt:
        first = prompt[0]
        if type(first) is int:
            if not all(type(t) is int and t >= 0 for t in prompt):
                raise _bad("a token-id 'prompt' must hold only integers >= 0", "prompt")
            return None, prompt
        if all(type(p) is str for p in prompt):
            return (prompt[0], None) if len(prompt) == 1 else (None, None)
        if all(type(p) is list and p and all(type(t) is int and t >= 0 for t in p) for p in prompt):
            return (None, prompt[0]) if len(prompt) == 1 else (None, None)
    raise _bad(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of "
        "token-id lists",
        "prompt",
    )


_ROLES = frozenset(("system", "developer", "user", "assistant", "tool", "function"))


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if type(messages) is not list or not messages:
        raise _bad("'messages' is required and must be a non-empty array", "messages")
    for i, message in enumerate(messages):
        if type(message) is not dict:
            raise _bad(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        if role not in _ROLES:
            raise _bad(
                f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}", "messages"
            )
        content = message.get("content")
        if content is None:
            if role != "assistant":
                raise _bad(f"messages[{i}].content is required for role {role!r}", "messages")
        elif type(content) is list:
            for part in content:
                if type(part) is not dict or type(part.get("type")) is not str:
                    raise _bad(
                        f"messages[{i}].content parts must be objects with a 'type'", "messages"
                    )
        elif type(content) is not str:
            raise _bad(f"messages[{i}].content must be a string or an array of parts", "messages")
    return messages


def message_text(message: dict[str, Any]) -> str:
    """The text of a message's content (text parts joined), for pseudo-tokenization."""
    content = message.get("content")
    if type(content) is str:
        return content
    if type(content) is list:
        return "".join(p.get("text", "") for p in content if type(p.get("text")) is str)
    return ""


def media_parts(messages: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Every content part of a chat that is not text: images, audio, video."""
    return [
        part
        for message in messages or ()
        if type(content := message.get("content")) is list
        for part in content
        if part.get("type") != "text"
    ]
