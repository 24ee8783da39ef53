"""A request's parameters and its mutable state inside the engine.

``SamplingParams`` holds SGLang's ``sampling_params`` keys we honour, validated at the HTTP
boundary (the penalties act as SGLang's do: presence and frequency over the output so far,
repetition over prompt and output); ``Request`` is the scheduler's record: page table, how
many tokens have KV, where the cached part came from, and the output so far.
``FinishReason`` renders as SGLang's ``meta_info.finish_reason`` object.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FinishReason", "Phase", "Request", "SamplingParams"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class FinishReason:
    kind: str  # "length" | "stop" | "abort"
    length: int | None = None
    matched: int | str | None = None
    message: str | None = None
    status_code: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind}
        if self.kind == "length":
            out["length"] = self.length
        elif self.kind == "stop":
            out["matched"] = self.matched
        else:
            out["message"] = self.message
            if self.status_code is not None:
                out["status_code"] = self.status_code
        return out

    @property
    def openai(self) -> str:
        return {"length": "length", "stop": "stop"}.get(self.kind, "abort")


@dataclass(slots=True, eq=False)
class Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    digests: list[bytes] = field(default_factory=list)  # event-chain digests of full pages
    storage_keys: list[str] = field(default_factory=list)  # HiCache keys of full pages
    pages: list[int] = field(default_factory=list)  # page table, position // page_size
    cache_refs: list[int] = field(default_factory=list)  # pages we hold a cache reference on
    inserted_pages: int = 0  # leading pages already in the prefix cache for this request
    reserved_pages: int = 0  # reserved but not yet allocated
    num_computed: int = 0  # tokens whose KV is in the pool
    cached_tokens_device: int = 0
    cached_tokens_storage: int = 0
    output_ids: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    finish: FinishReason | None = None
    export_pages: bool = False  # prefill role: write the prompt's pages to the page store
    exported_pages: int = 0  # prefill role: leading prompt pages the store confirmed
    require_import: bool = False  # decode role: the prompt's pages must come from the store
    arrival: float = 0.0
    first_token_time: float | None = None

    @property
    def cached_tokens(self) -> int:
        return self.cached_tokens_device + self.cached_tokens_storage

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output_ids)

    def all_tokens(self) -> list[int]:
        return self.prompt + self.output_ids
