"""SGLang's ``/generate`` split over a prefill and a decode engine (``PrefillDecode``).

The prefill leg is the request with ``max_new_tokens`` 1, not streamed; an engine serving the
prefill role exports the prompt's pages to its HiCache storage and names them in
``meta_info.kv_transfer.page_keys`` (the reference engine does; with SGLang's own HiCache
the decode engine finds them in shared storage). The decode leg continues from
``prompt + [first token]`` with ``kv_transfer: {"page_keys": [...]}``, which an engine that
cannot import those pages refuses with 409. The first token's id continues the prompt, so
greedy and seeded sampling go on exactly as one engine would.

SGLang's own PD transfer (``TokenizedRequest.bootstrap``) travels as its ``bootstrap_host``,
``bootstrap_port`` and ``bootstrap_room`` fields (``requests.to_generate_request``); a prefill
engine serves it on ``--disaggregation-bootstrap-port``, 8998 by default.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import msgspec

from adapters.base import EngineRequest, PrefillResult
from adapters.sglang.hicache_keys import HiCacheKeyMap, ShardCoordinates
from adapters.sglang.requests import to_generate_request
from kvcore.requests import TokenizedRequest

__all__ = ["DEFAULT_BOOTSTRAP_PORT", "SGLangPrefillDecode"]

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
_IMPORT_FAILED = 409  # the decode engine could not import the prompt's pages


class SGLangPrefillDecode:
    """The two legs of one SGLang request and the page keys between them."""

    def prefill_request(self, request: TokenizedRequest) -> EngineRequest:
        leg = msgspec.structs.replace(request, max_tokens=1, stream=False, include_usage=False)
        return to_generate_request(leg)

    def prefill_result(
        self, request: TokenizedRequest, body: Mapping[str, Any], seconds: float
    ) -> PrefillResult:
        meta = body.get("meta_info") or {}
        if not isinstance(meta, Mapping):
            raise ValueError(f"prefill answer without meta_info: {str(dict(body))[:200]}")
        transfer = meta.get("kv_transfer") or {}
        output_ids = [int(t) for t in body.get("output_ids") or []]
        finish = meta.get("finish_reason")
        return PrefillResult(
            output_ids=output_ids,
            text=str(body.get("text") or ""),
            finished=not output_ids or _finished(request, finish),
            finish_reason=finish,
            cached_tokens=int(meta.get("cached_tokens") or 0),
            handoff_keys=[str(k) for k in transfer.get("page_keys") or []],
            seconds=seconds,
        )

    def first_object(self, request: TokenizedRequest, prefill: PrefillResult) -> dict[str, Any]:
        finish = prefill.finish_reason if prefill.finished else None
        return {
            "text": prefill.text,
            "output_ids": prefill.output_ids,
            "meta_info": _meta_info(request, prefill, finish, 0),
        }

    def decode_request(self, request: TokenizedRequest, prefill: PrefillResult) -> EngineRequest:
        remaining = None if request.max_tokens is None else request.max_tokens - 1
        leg = msgspec.structs.replace(
            request,
            prompt_token_ids=[*request.prompt_token_ids, *prefill.output_ids],
            max_tokens=remaining,
            stream=True,
            extra={**request.extra, "kv_transfer": {"page_keys": prefill.handoff_keys}},
        )
        return to_generate_request(leg)

    async def stitched(
        self,
        request: TokenizedRequest,
        prefill: PrefillResult,
        head: dict[str, Any],
        rest: AsyncIterator[dict[str, Any]],
    ) -> AsyncIterator[dict[str, Any]]:
        data: dict[str, Any] | None = head
        while data is not None:
            meta = data.get("meta_info") or {}
            ids = data.get("output_ids") or []
            yield {
                "text": prefill.text + str(data.get("text") or ""),
                "output_ids": [*prefill.output_ids, *ids],
                "meta_info": _meta_info(request, prefill, meta.get("finish_reason"), len(ids)),
            }
            data = await anext(rest, None)

    def store_keys(self, model_id: str, handoff_keys: Sequence[str]) -> list[tuple[int, int]]:
        return HiCacheKeyMap(model_id, ShardCoordinates()).store_keys(handoff_keys)

    def import_failed(self, status: int) -> bool:
        return status == _IMPORT_FAILED

    def bootstrap_address(self, engine_url: str, port: int | None) -> tuple[str, int] | None:
        host = urlsplit(engine_url).hostname or "127.0.0.1"
        return host, port or DEFAULT_BOOTSTRAP_PORT


def _finished(request: TokenizedRequest, finish: Any) -> bool:
    """Whether the first token ended the request: ``max_tokens`` 1, or EOS / a stop."""
    if finish is None:
        return False
    if request.max_tokens is not None and request.max_tokens <= 1:
        return True
    kind = finish.get("type") if isinstance(finish, Mapping) else finish
    return bool(kind != "length")


def _meta_info(
    request: TokenizedRequest, prefill: PrefillResult, finish: Any, decoded: int
) -> dict[str, Any]:
    return {
        "prompt_tokens": len(request.prompt_token_ids),
        "completion_tokens": len(prefill.output_ids) + decoded,
        "cached_tokens": prefill.cached_tokens,
        "finish_reason": finish,
    }
