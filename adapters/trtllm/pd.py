"""trtllm-serve's ``disaggregated_params`` split over a prefill and a decode engine
(``PrefillDecode``): TensorRT-LLM moves the KV itself, our sidecars carry its handoff state.

The legs are the ones trtllm-serve's own disaggregated server sends
(``serve/openai_disagg_service.py``, context first), on ``/v1/completions`` with the
prompt's token ids:

* **prefill** (a trtllm-serve with a ``cache_transceiver_config``, serving the context
  role): the request, not streamed, with ``"disaggregated_params": {"request_type":
  "context_only"}``. Its answer's ``choices[0].disaggregated_params`` is the handoff
  state: ``first_gen_tokens`` (the first token), ``ctx_request_id``,
  ``encoded_opaque_state`` (base64: where and how the generation engine fetches the KV),
  ``draft_tokens`` and, in newer releases, ``disagg_request_id``, ``ctx_dp_rank`` (the
  attention-DP rank holding the KV) and ``ctx_info_endpoint``. ``finish_reason`` other than
  ``length`` or ``not_finished`` means the first token already ended the request.
* **decode**: the same request, streamed, with that object verbatim and ``request_type``
  ``generation_only``; the generation engine pulls the KV from the context engine (UCX,
  NIXL or MPI, its own transceiver) and answers the whole completion, the first token
  included, as trtllm-serve's disaggregated server relays it to its clients.

So nothing moves between our sidecars (no handoff keys), and ``first_object`` sends nothing
before the decode engine answers unless the prefill finished the request: the decode
engine's stream is the answer. Its usage is the client's, with the prompt's cached tokens
from the prefill engine (the decode engine computed no prompt token). Only the fields the
context engine returned go back to it: trtllm-serve's request models forbid unknown fields,
so the state is echoed, never extended.

Newer trtllm-serve releases authenticate the state's transfer fields
(``encoded_opaque_state``, ``ctx_info_endpoint``) with an HMAC-SHA256 header keyed by the
engines' ``internal_request_auth_key`` (``serve/disagg_auth.py``); given that key
(``auth_key``), the decode leg carries ``x-trtllm-disagg-auth``. A decode engine that cannot
continue (it could not receive the KV) answers a server error before its first chunk, which
``import_failed`` reports as a failed transfer so the gateway serves the request aggregated.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import msgspec

from adapters.base import EngineRequest, PrefillResult
from adapters.trtllm.requests import to_completions_request
from kvcore.requests import TokenizedRequest

__all__ = ["AUTH_HEADER", "TrtllmPrefillDecode", "auth_header"]

AUTH_HEADER = "x-trtllm-disagg-auth"
_UNFINISHED = (None, "length", "not_finished")  # the decode leg goes on


def auth_header(key: str, params: Mapping[str, Any]) -> str:
    """trtllm-serve's internal disaggregation signature of a leg's transfer fields:
    ``sha256=`` and the hex HMAC-SHA256, keyed by ``key``, of their compact sorted JSON."""
    endpoint = params.get("ctx_info_endpoint")
    if isinstance(endpoint, list):
        endpoint = endpoint[0] if endpoint else None
    payload = {"ctx_info_endpoint": endpoint,
               "encoded_opaque_state": params.get("encoded_opaque_state")}
    raw = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return "sha256=" + hmac.new(key.encode(), raw, hashlib.sha256).hexdigest()


class TrtllmPrefillDecode:
    """The two legs of one trtllm-serve request and the ``disaggregated_params`` between."""

    def __init__(self, auth_key: str | None = None) -> None:
        self._auth_key = auth_key

    def prefill_request(self, request: TokenizedRequest) -> EngineRequest:
        native = self._completions(request, stream=False)
        body = {**native.body, "disaggregated_params": {"request_type": "context_only"}}
        return EngineRequest(native.path, body, False)

    def prefill_result(
        self, request: TokenizedRequest, body: Mapping[str, Any], seconds: float
    ) -> PrefillResult:
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
            raise ValueError(f"context answer without choices: {str(dict(body))[:200]}")
        choice = choices[0]
        finish = choice.get("finish_reason")
        params = choice.get("disaggregated_params")
        finished = finish not in _UNFINISHED
        if not isinstance(params, Mapping) or params.get("request_type") != "context_only":
            if not finished:
                raise ValueError(
                    "the prefill engine answered without context_only disaggregated_params "
                    "(is it a trtllm-serve with a cache_transceiver_config?): "
                    f"{str(dict(choice))[:200]}"
                )
            params = {}
        first = params.get("first_gen_tokens") or choice.get("token_ids") or []
        return PrefillResult(
            output_ids=[int(t) for t in first],
            text=str(choice.get("text") or ""),
            finished=finished,
            finish_reason=finish,
            cached_tokens=_cached_tokens(body.get("usage")),
            handoff_keys=[],
            seconds=seconds,
            engine_state=dict(params),
        )

    def first_object(self, request: TokenizedRequest, prefill: PrefillResult) -> dict[str, Any]:
        if not prefill.finished:
            # The decode engine's answer starts with this token: nothing to send before it.
            return {"choices": [{"index": 0, "text": "", "finish_reason": None}]}
        return {
            "choices": [{"index": 0, "text": prefill.text,
                         "finish_reason": prefill.finish_reason}],
            "usage": _usage(len(request.prompt_token_ids), max(1, len(prefill.output_ids)),
                            prefill.cached_tokens),
        }

    def decode_request(self, request: TokenizedRequest, prefill: PrefillResult) -> EngineRequest:
        params = {**prefill.engine_state, "request_type": "generation_only"}
        native = self._completions(request, stream=True)
        headers: dict[str, str] = {}
        protected = params.get("encoded_opaque_state") is not None or (
            params.get("ctx_info_endpoint") is not None)
        if self._auth_key and protected:
            headers[AUTH_HEADER] = auth_header(self._auth_key, params)
        return EngineRequest(native.path, {**native.body, "disaggregated_params": params}, True,
                             headers=headers)

    async def stitched(
        self,
        request: TokenizedRequest,
        prefill: PrefillResult,
        head: dict[str, Any],
        rest: AsyncIterator[dict[str, Any]],
    ) -> AsyncIterator[dict[str, Any]]:
        """The decode engine's chunks (usage with the prefill's cached tokens); for a client
        that did not stream, one object at the end holding the whole text."""
        text: list[str] = []
        finish: Any = None
        usage: dict[str, Any] | None = None
        pieces = 0
        data: dict[str, Any] | None = head
        while data is not None:
            if isinstance(data.get("usage"), Mapping):
                data = {**data, "usage": _with_cached(data["usage"], prefill.cached_tokens)}
                usage = data["usage"]
            if request.stream:
                yield data
            else:
                for choice in data.get("choices") or ():
                    piece = str(choice.get("text") or "")
                    pieces += bool(piece)
                    text.append(piece)
                    finish = choice.get("finish_reason") or finish
            data = await anext(rest, None)
        if not request.stream:
            if usage is None:
                usage = _usage(len(request.prompt_token_ids), pieces, prefill.cached_tokens)
            yield {"choices": [{"index": 0, "text": "".join(text), "finish_reason": finish}],
                   "usage": usage}

    def store_keys(self, model_id: str, handoff_keys: Sequence[str]) -> list[tuple[int, int]]:
        return []  # the engines move the KV themselves: nothing for the sidecars to pull

    def import_failed(self, status: int) -> bool:
        return status >= 500

    def bootstrap_address(self, engine_url: str, port: int | None) -> tuple[str, int] | None:
        return None  # the handoff state travels in the legs, not through a bootstrap server

    @staticmethod
    def _completions(request: TokenizedRequest, *, stream: bool) -> EngineRequest:
        if request.openai is not None:
            raise ValueError(
                "a request for the engine's own OpenAI parsing is served aggregated, not split")
        leg = msgspec.structs.replace(request, stream=stream, include_usage=stream,
                                      handoff=None)
        return to_completions_request(leg)


def _cached_tokens(usage: Any) -> int:
    if not isinstance(usage, Mapping):
        return 0
    details = usage.get("prompt_tokens_details")
    return int(details.get("cached_tokens") or 0) if isinstance(details, Mapping) else 0


def _with_cached(usage: Mapping[str, Any], cached: int) -> dict[str, Any]:
    details = usage.get("prompt_tokens_details")
    details = dict(details) if isinstance(details, Mapping) else {}
    return {**usage, "prompt_tokens_details": {**details, "cached_tokens": cached}}


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
