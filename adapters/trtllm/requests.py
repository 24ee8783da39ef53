"""OpenAI (already tokenized) → ``trtllm-serve`` ``POST /v1/completions`` with a token-id
prompt, and back.

trtllm-serve's request models forbid unknown fields, and none names an attention-DP rank:
a request's ``dp_rank`` is not sent (the engine picks the rank; see ``adapter``).

Chat requests go to ``/v1/completions`` too: the gateway already applied the chat template
and tokenized, and ``CompletionRequest.prompt`` accepts ``List[int]``; the answers are then
rebuilt as chat objects. ``usage.prompt_tokens_details.cached_tokens`` is passed through
when the engine reports it.

trtllm-serve's ``CompletionRequest`` has no ``cache_salt`` and selects a LoRA adapter by a full
``lora_request`` (name, integer id, checkpoint path), never by name alone: a salted request is
refused here rather than served unsalted, and an adapter must be one the sidecar was told
about (``--lora-adapter NAME=ID[:PATH]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapters.base import EngineRequest, LoraAdapter, engine_openai_request
from adapters.normalize_openai import OpenAIBuilder, Usage, error_from_engine
from kvcore.errors import OpenAIError
from kvcore.requests import TokenizedRequest

__all__ = ["TrtllmResponseTranslator", "to_completions_request"]

_PASS = (
    "max_tokens",
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


def to_completions_request(
    request: TokenizedRequest, lora_adapters: Mapping[str, LoraAdapter] | None = None
) -> EngineRequest:
    """The ``/v1/completions`` body for ``request`` (or, with an OpenAI body, that body for
    trtllm-serve's own OpenAI routes). ``lora_adapters``: the engine's adapters by name."""
    if request.openai is not None:
        return engine_openai_request(request)
    if request.bootstrap is not None:
        raise ValueError(
            "TensorRT-LLM has no bootstrap room: its engines hand the KV over through "
            "disaggregated_params, which the sidecars carry; run the gateway with --pd-mode "
            "auto (or off)"
        )
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
    if request.cache_salt is not None:
        raise ValueError(
            "trtllm-serve's /v1/completions takes no cache_salt, so this request cannot be "
            "cached apart from other tenants' on TensorRT-LLM; send it without one or to an "
            "SGLang worker"
        )
    if request.lora_name is not None:
        body["lora_request"] = _lora_request(request.lora_name, lora_adapters or {})
    for key, value in request.extra.items():
        if key in body:
            raise ValueError(f"extra field {key!r} would overwrite a translated field")
        body[key] = value
    return EngineRequest("/v1/completions", body, request.stream)


def _lora_request(name: str, adapters: Mapping[str, LoraAdapter]) -> dict[str, Any]:
    adapter = adapters.get(name)
    if adapter is None:
        known = ", ".join(sorted(adapters)) or "none"
        raise ValueError(
            f"LoRA adapter {name!r} is not one this sidecar knows (known: {known}); "
            "TensorRT-LLM selects adapters by id: start the sidecar with "
            "--lora-adapter NAME=ID[:PATH] for each adapter the engine serves"
        )
    body: dict[str, Any] = {"lora_name": adapter.name, "lora_int_id": adapter.int_id}
    if adapter.path:
        body["lora_path"] = adapter.path
    return body


class TrtllmResponseTranslator:
    """Rebuilds one request's completions answers as the client's OpenAI objects."""

    def __init__(self, request: TokenizedRequest, *, created: int | None = None) -> None:
        self.builder = OpenAIBuilder(request, created)
        self._usage: Usage | None = None

    def response(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if body.get("object") == "error" or "error" in body:
            raise error_from_engine("trtllm", _status(body), dict(body))
        choice = _first_choice(body)
        self._usage = _usage(body)
        return self.builder.response(
            str(choice.get("text") or ""), choice.get("finish_reason"), self._usage or Usage(0, 0)
        )

    def chunk(self, data: Mapping[str, Any]) -> list[dict[str, Any]]:
        if data.get("object") == "error" or "error" in data:
            raise error_from_engine("trtllm", _status(data), dict(data))
        usage = _usage(data)
        if usage is not None:
            self._usage = usage
        choices = data.get("choices") or []
        if not choices:
            return []
        choice = _first_choice(data)
        text = str(choice.get("text") or "")
        finish = choice.get("finish_reason")
        if not text and finish is None:
            return []
        return [self.builder.chunk(text, finish)]

    def token_ids(self) -> list[int] | None:
        """None: trtllm-serve's completions stream text, not the ids it generated."""
        return None

    def finish(self) -> list[dict[str, Any]]:
        if self.builder.request.include_usage and self._usage is not None:
            return [self.builder.usage_chunk(self._usage)]
        return []

    def cached_tokens(self) -> int | None:
        """None too when a stream carried no usage (the client did not ask for it)."""
        return None if self._usage is None else self._usage.cached_tokens

    def error(self, status: int, body: bytes) -> OpenAIError:
        return error_from_engine("trtllm", status, body)


def _first_choice(body: Mapping[str, Any]) -> Mapping[str, Any]:
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        raise OpenAIError(
            502,
            f"trtllm engine error: answer without choices: {str(dict(body))[:200]}",
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
