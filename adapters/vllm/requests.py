"""OpenAI (already tokenized) → vLLM ``POST /v1/completions`` with a token-id prompt, and back.

Like ``adapters.sglang.requests`` for SGLang's ``/generate``: a request the gateway
tokenized goes as token ids (so the engine hashes exactly the blocks the gateway placed by),
one with an OpenAI body to vLLM's own OpenAI routes as it came. vLLM's completions take what
SGLang's native route does: ``cache_salt``, ``priority``, a LoRA adapter selected by its name
as ``model``, ``return_token_ids`` (the generated ids, per choice) and a target DP rank in
the ``X-data-parallel-rank`` header (``vllm/entrypoints/openai/api_server.py``).
``usage.prompt_tokens_details.cached_tokens`` needs vLLM's ``--enable-prompt-tokens-details``.
"""

from __future__ import annotations

from adapters.base import EngineRequest, engine_openai_request
from adapters.completions import CompletionsResponseTranslator, completions_body
from kvcore.requests import TokenizedRequest

__all__ = ["DP_RANK_HEADER", "VllmResponseTranslator", "to_completions_request"]

DP_RANK_HEADER = "X-data-parallel-rank"


def to_completions_request(request: TokenizedRequest) -> EngineRequest:
    """The ``/v1/completions`` body for ``request`` (or, with an OpenAI body, that body for
    vLLM's own OpenAI routes)."""
    headers = {} if request.dp_rank is None else {DP_RANK_HEADER: str(request.dp_rank)}
    if request.openai is not None:
        native = engine_openai_request(request)
        return EngineRequest(native.path, native.body, native.stream, openai=True,
                             headers=headers)
    if request.bootstrap is not None:
        raise ValueError(
            "vLLM has no bootstrap room here: run the gateway with --pd-mode auto (or off)"
        )
    body = completions_body(request)
    body["return_token_ids"] = True
    if request.lora_name is not None:
        body["model"] = request.lora_name
    if request.cache_salt is not None:
        body["cache_salt"] = request.cache_salt
    if request.priority is not None:
        body["priority"] = request.priority
    for key, value in request.extra.items():
        if key in body:
            raise ValueError(f"extra field {key!r} would overwrite a translated field")
        body[key] = value
    return EngineRequest("/v1/completions", body, request.stream, headers=headers)


class VllmResponseTranslator(CompletionsResponseTranslator):
    """Rebuilds one request's vLLM completions answers as the client's OpenAI objects."""

    def __init__(self, request: TokenizedRequest, *, created: int | None = None) -> None:
        super().__init__(request, "vllm", created=created)
