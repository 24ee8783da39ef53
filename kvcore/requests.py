"""What the gateway sends a sidecar: the client's request, already tokenized and placed.

``POST /v1/kvsidecar/generate`` (and the prefill/decode legs) take a ``TokenizedRequest``
as JSON. The gateway has rendered the chat template and tokenized, so the sidecar forwards
exactly the token ids the gateway hashed; sampling parameters travel as OpenAI named them
and the engine's adapter translates them into the engine's names.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

__all__ = ["RequestKind", "TokenizedRequest"]


class RequestKind(enum.Enum):
    COMPLETION = "completion"
    CHAT = "chat"


class TokenizedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """An OpenAI completions/chat request after the gateway tokenized it (chat template
    applied): what every adapter translates into its engine's native request."""

    request_id: str
    model: str
    kind: RequestKind
    prompt_token_ids: list[int]
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    n: int = 1
    lora_name: str | None = None
    cache_salt: str | None = None
    priority: int | None = None
    dp_rank: int | None = None
    # Engine-specific fields passed through verbatim (PD bootstrap_*, disaggregated_params).
    extra: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported; send n separate requests")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")

