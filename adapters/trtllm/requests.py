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
from adapters.completions import CompletionsResponseTranslator, completions_body
from kvcore.requests import TokenizedRequest

__all__ = ["TrtllmResponseTranslator", "to_completions_request"]

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
    body = completions_body(request)
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


class TrtllmResponseTranslator(CompletionsResponseTranslator):
    """Rebuilds one request's trtllm-serve completions answers as the client's OpenAI
    objects (its completions stream text, not the ids it generated)."""

    def __init__(self, request: TokenizedRequest, *, created: int | None = None) -> None:
        super().__init__(request, "trtllm", created=created)

    def token_ids(self) -> list[int] | None:
        return None
