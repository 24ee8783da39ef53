"""OpenAI's ``/v1/completions`` with a token-id prompt: the body every engine that takes one
shares, and its answers rebuilt as the client's OpenAI objects (a chat request's too: the
gateway already applied the chat template and tokenized).

``usage.prompt_tokens_details.cached_tokens`` is passed through when the engine reports it;
a choice's ``token_ids`` (vLLM's ``return_token_ids``) are what the engine generated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapters.normalize_openai import ReplyTranslator, Usage, error_from_engine
from kvcore.errors import OpenAIError
from kvcore.requests import TokenizedRequest

__all__ = ["CompletionsResponseTranslator", "completions_body"]

_PASS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def completions_body(request: TokenizedRequest) -> dict[str, Any]:
    """The engine-neutral part of ``request``'s ``/v1/completions`` body: model, token-id
    prompt, stream and sampling parameters."""
    body: dict[str, Any] = {
        "model": request.model,
        "prompt": request.prompt_token_ids,
        "stream": request.stream,
    }
    for name in _PASS:
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    if request.ignore_eos:
        body["ignore_eos"] = True
    if request.stream and request.include_usage:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": False}
    return body


class CompletionsResponseTranslator(ReplyTranslator):
    """Rebuilds one request's completions answers as the client's OpenAI objects."""

    def __init__(
        self, request: TokenizedRequest, engine: str, *, created: int | None = None
    ) -> None:
        super().__init__(request, engine, created)

    def response(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if body.get("object") == "error" or "error" in body:
            raise error_from_engine(self._engine, _status(body), dict(body))
        choice = self._first_choice(body)
        self._usage = _usage(body)
        return self.builder.response(
            str(choice.get("text") or ""), choice.get("finish_reason"), self._usage or Usage(0, 0)
        )

    def chunk(self, data: Mapping[str, Any]) -> list[dict[str, Any]]:
        if data.get("object") == "error" or "error" in data:
            raise error_from_engine(self._engine, _status(data), dict(data))
        usage = _usage(data)
        if usage is not None:
            self._usage = usage
        choices = data.get("choices") or []
        if not choices:
            return []
        choice = self._first_choice(data)
        self._take_ids(choice.get("token_ids"))
        text = str(choice.get("text") or "")
        finish = choice.get("finish_reason")
        if not text and finish is None:
            return []
        return [self.builder.chunk(text, finish)]

    def _take_ids(self, ids: Any) -> None:
        if self._ids is None:
            return
        if isinstance(ids, list):
            self._ids += ids
        else:
            self._ids = None  # this engine does not say which tokens it streamed

    def _first_choice(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
            raise OpenAIError(
                502,
                f"{self._engine} engine error: answer without choices: {str(dict(body))[:200]}",
            )
        return choices[0]


def _usage(body: Mapping[str, Any]) -> Usage | None:
    usage = body.get("usage")
    if not isinstance(usage, Mapping):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return Usage(
        int(usage.get("prompt_tokens") or 0),
        int(usage.get("completion_tokens") or 0),
        int(cached) if cached is not None else None,
    )


def _status(body: Mapping[str, Any]) -> int:
    code = body.get("code")
    if code is None and isinstance(body.get("error"), Mapping):
        code = body["error"].get("code")
    return code if isinstance(code, int) and 400 <= code <= 599 else 400
