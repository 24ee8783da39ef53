"""The body a sidecar worker gets: the client's OpenAI request, tokenized (``TokenizedRequest``).

Two paths, chosen per request (``takes_token_path``): a request made only of what token ids
and sampling parameters express exactly goes as token ids (the engine's ``/generate``: it
caches exactly the blocks the gateway hashed); any other field (tools, response_format,
logprobs, n > 1, images, a field this translation does not know, a value of a type it does
not expect) sends the client's body along too, for the engine's own OpenAI server
(``EngineOpenAI``), so nothing the client asked for is dropped.

The gateway has already rendered the chat template and tokenized, so the sidecar forwards
exactly the token ids the gateway hashed; sampling parameters travel as OpenAI named them
and the adapter translates them to the engine's names.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvcore.errors import OpenAIError
from kvcore.requests import (
    Bootstrap,
    Continuation,
    EngineOpenAI,
    Handoff,
    PrefixSource,
    RequestKind,
    TokenizedRequest,
)
from routing.prompt.openai_api import Endpoint, OpenAIRequest, media_parts

__all__ = ["takes_token_path", "tokenized_body"]

_encoder = msgspec.json.Encoder()
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty")
_INTS = ("top_k", "seed", "priority", "min_tokens")


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _strings(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


# Every field the token path carries exactly, and what its value must be. The gateway itself
# consumes model, messages, prompt, stream(_options), the token limits, cache_salt and the
# template's arguments (its tokens reflect them).
_TOKEN_PATH: dict[str, Any] = {
    # Images and other media reach the engine only through its own OpenAI server.
    "messages": lambda v: not media_parts(v),
    **dict.fromkeys(("model", "prompt", "stream", "stream_options", "max_tokens",
                     "max_completion_tokens", "cache_salt", "add_generation_prompt",
                     "chat_template_kwargs"), lambda v: True),
    **dict.fromkeys(_FLOATS, _number),
    **dict.fromkeys(_INTS, lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "stop": lambda v: v is None or _strings(v),
    "stop_token_ids": lambda v: v is None or (isinstance(v, list)
                                              and all(type(t) is int for t in v)),
    "ignore_eos": lambda v: isinstance(v, bool),
    "n": lambda v: v in (1, None),
}


def takes_token_path(req: OpenAIRequest) -> bool:
    """Whether token ids and sampling parameters say everything the client asked for."""
    for name, value in req.body.items():
        check = _TOKEN_PATH.get(name)
        if check is None or (value is not None and not check(value)):
            return False
    return True


def tokenized_body(
    req: OpenAIRequest,
    token_ids: list[int],
    request_id: str,
    dp_rank: int | None,
    *,
    handoff: Handoff | None = None,
    bootstrap: Bootstrap | None = None,
    stream: bool | None = None,
    token_path: bool = True,
    stream_token_ids: bool = False,
    continuation: Continuation | None = None,
    prefix_source: PrefixSource | None = None,
) -> bytes:
    """The JSON body of one leg to a sidecar (``/v1/kvsidecar/generate``, or with
    ``handoff`` ``/v1/kvsidecar/pd/generate``); ``stream`` overrides the client's; without
    ``token_path`` the client's body goes along for the engine's OpenAI server;
    ``stream_token_ids`` and ``continuation``: a stream that may migrate, and its resumption;
    ``prefix_source``: a moved prefix's holder, for the sidecar to pull from."""
    body = req.body
    openai = None if token_path else EngineOpenAI(req.endpoint.value, body)
    fields: dict[str, Any] = {}
    for name in _FLOATS:
        value = body.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            fields[name] = float(value)
    for name in _INTS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            fields[name] = value
    stop = body.get("stop")
    if isinstance(stop, str):
        fields["stop"] = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        fields["stop"] = stop
    stop_ids = body.get("stop_token_ids")
    if isinstance(stop_ids, list) and all(isinstance(t, int) for t in stop_ids):
        fields["stop_token_ids"] = stop_ids
    try:
        request = TokenizedRequest(
            request_id=request_id,
            model=req.model,
            kind=RequestKind.CHAT if req.endpoint is Endpoint.CHAT else RequestKind.COMPLETION,
            prompt_token_ids=token_ids,
            stream=req.stream if stream is None else stream,
            include_usage=req.include_usage,
            max_tokens=req.max_tokens,
            ignore_eos=bool(body.get("ignore_eos", False)),
            cache_salt=req.cache_salt,
            lora_name=req.lora_name,
            dp_rank=dp_rank,
            handoff=handoff,
            bootstrap=bootstrap,
            openai=openai,
            stream_token_ids=stream_token_ids and token_path,
            continuation=continuation,
            prefix_source=prefix_source,
            **fields,
        )
    except (ValueError, TypeError) as exc:
        raise OpenAIError(400, f"cannot forward this request to a sidecar: {exc}") from exc
    return _encoder.encode(request)
