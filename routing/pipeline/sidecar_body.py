"""The body a sidecar worker gets: the client's OpenAI request, tokenized (``TokenizedRequest``).

The gateway has already rendered the chat template and tokenized, so the sidecar forwards
exactly the token ids the gateway hashed; sampling parameters travel as OpenAI named them
and the adapter translates them to the engine's names.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvcore.errors import OpenAIError
from kvcore.requests import Bootstrap, Handoff, RequestKind, TokenizedRequest
from routing.prompt.openai_api import Endpoint, OpenAIRequest

__all__ = ["tokenized_body"]

_encoder = msgspec.json.Encoder()
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty")
_INTS = ("top_k", "seed", "priority")


def tokenized_body(
    req: OpenAIRequest,
    token_ids: list[int],
    request_id: str,
    dp_rank: int | None,
    *,
    handoff: Handoff | None = None,
    bootstrap: Bootstrap | None = None,
    stream: bool | None = None,
) -> bytes:
    """The JSON body of one leg to a sidecar (``/v1/kvsidecar/generate``, or with
    ``handoff`` ``/v1/kvsidecar/pd/generate``); ``stream`` overrides the client's."""
    body = req.body
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
    n = body.get("n", 1)
    if n not in (1, None):
        raise OpenAIError(400, f"n={n} is not supported by sidecar workers; send n requests",
                       param="n")
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
            dp_rank=dp_rank,
            handoff=handoff,
            bootstrap=bootstrap,
            **fields,
        )
    except (ValueError, TypeError) as exc:
        raise OpenAIError(400, f"cannot forward this request to a sidecar: {exc}") from exc
    return _encoder.encode(request)
