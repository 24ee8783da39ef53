"""OpenAI (already tokenized) → SGLang ``POST /generate`` with ``input_ids``, and back.

``/generate`` answers ``{"text", "output_ids", "meta_info": {"id", "finish_reason",
"prompt_tokens", "completion_tokens", "cached_tokens", ...}}``; streamed, each SSE ``data:``
is such an object where ``text`` is cumulative (SGLang's default) or a delta (with
``--incremental-streaming-output``), then ``data: [DONE]``. A streamed error arrives as
``data: {"error": {...}}``. ``cached_tokens`` becomes ``usage.prompt_tokens_details``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapters.base import EngineRequest, engine_openai_request
from adapters.normalize_openai import ReplyTranslator, Usage, error_from_engine
from kvcore.errors import OpenAIError
from kvcore.requests import TokenizedRequest

__all__ = ["SGLangResponseTranslator", "to_generate_request"]

_SAMPLING_FIELDS = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "seed": "sampling_seed",
}


def to_generate_request(request: TokenizedRequest) -> EngineRequest:
    """The ``/generate`` body for ``request`` (token ids, sampling params, routing fields); a
    request with an OpenAI body goes to SGLang's OpenAI server instead, with its ``rid``."""
    if request.openai is not None:
        return engine_openai_request(request, {"rid": request.request_id})
    sampling: dict[str, Any] = {}
    for ours, theirs in _SAMPLING_FIELDS.items():
        value = getattr(request, ours)
        if value is not None:
            sampling[theirs] = value
    if request.ignore_eos:
        sampling["ignore_eos"] = True
    body: dict[str, Any] = {
        "input_ids": request.prompt_token_ids,
        "sampling_params": sampling,
        "stream": request.stream,
        "rid": request.request_id,
    }
    if request.lora_name is not None:
        body["lora_path"] = request.lora_name
    if request.cache_salt is not None:
        body["cache_salt"] = request.cache_salt
    if request.priority is not None:
        body["priority"] = request.priority
    if request.dp_rank is not None:
        body["routed_dp_rank"] = request.dp_rank
    if request.bootstrap is not None:  # SGLang's own PD transfer: both legs name one room
        body["bootstrap_host"] = request.bootstrap.host
        body["bootstrap_port"] = request.bootstrap.port
        body["bootstrap_room"] = request.bootstrap.room
    for key, value in request.extra.items():
        if key in body:
            raise ValueError(f"extra field {key!r} would overwrite a translated field")
        body[key] = value
    return EngineRequest("/generate", body, request.stream)


_FINISH = {"stop": "stop", "length": "length"}


class SGLangResponseTranslator(ReplyTranslator):
    """Translates one request's ``/generate`` answers into OpenAI objects."""

    def __init__(
        self, request: TokenizedRequest, *, incremental: bool = False, created: int | None = None
    ) -> None:
        super().__init__(request, "sglang", created)
        self._incremental = incremental
        self._sent = 0  # characters of cumulative text already sent
        self._finished = False
        self._ids_seen = 0  # cumulative output_ids already taken

    def response(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if "error" in body:
            raise error_from_engine(self._engine, _status_of(body), dict(body))
        meta = _meta(body)
        finish = self._finish_reason(meta)
        self._usage = _usage(meta)
        return self.builder.response(str(body.get("text") or ""), finish, self._usage)

    def chunk(self, data: Mapping[str, Any]) -> list[dict[str, Any]]:
        if "error" in data:
            raise error_from_engine(self._engine, _status_of(data), dict(data))
        if self._finished:
            return []
        meta = _meta(data)
        self._take_ids(data.get("output_ids"))
        text = str(data.get("text") or "")
        if not self._incremental:
            delta = text[self._sent :]
            self._sent = max(self._sent, len(text))
        else:
            delta = text
        finish = self._finish_reason(meta)
        self._usage = _usage(meta)
        if finish is not None:
            self._finished = True
        if not delta and finish is None:
            return []
        return [self.builder.chunk(delta, finish)]

    def _take_ids(self, ids: Any) -> None:
        if self._ids is None:
            return
        if not isinstance(ids, list):
            self._ids = None  # this engine does not say which tokens it streamed
        elif self._incremental:
            self._ids += ids
        else:
            self._ids += ids[self._ids_seen:]
            self._ids_seen = max(self._ids_seen, len(ids))

    @staticmethod
    def _finish_reason(meta: Mapping[str, Any]) -> str | None:
        reason = meta.get("finish_reason")
        if reason is None:
            return None
        kind = reason.get("type") if isinstance(reason, Mapping) else str(reason)
        if kind == "abort":
            message = reason.get("message") if isinstance(reason, Mapping) else None
            status = reason.get("status_code") if isinstance(reason, Mapping) else None
            code = int(status) if isinstance(status, int) else 500
            raise error_from_engine(
                "sglang", code, {"error": {"message": message or "request aborted by SGLang"}}
            )
        return _FINISH.get(str(kind), str(kind))


def _meta(body: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = body.get("meta_info")
    if not isinstance(meta, Mapping):
        raise OpenAIError(
            502,
            f"sglang engine error: answer without meta_info: {str(dict(body))[:200]}",
        )
    return meta


def _usage(meta: Mapping[str, Any]) -> Usage:
    cached = meta.get("cached_tokens")
    return Usage(
        int(meta.get("prompt_tokens") or 0),
        int(meta.get("completion_tokens") or 0),
        int(cached) if cached is not None else None,
    )


def _status_of(body: Mapping[str, Any]) -> int:
    err = body.get("error")
    code = err.get("code") if isinstance(err, Mapping) else None
    return code if isinstance(code, int) and 400 <= code <= 599 else 400
